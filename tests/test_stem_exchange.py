"""Row fetch and gradient push between data-parallel ranks (gloo, 2 and 3 ranks): fetched rows equal
the global table's, pushed gradients arrive summed at their owners, for contiguous and interleaved
ownership and for replicated tables. The checks run inside ``tests/dist/stem_exchange_check.py``."""

from __future__ import annotations

import os

import pytest

from multirank import ROOT, launch_ranks

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

SCRIPT = os.path.join(ROOT, "tests", "dist", "stem_exchange_check.py")


@pytest.mark.parametrize("nproc", [2, 3])
def test_exchange(nproc):
    status, log = launch_ranks([SCRIPT], nproc, timeout=300)
    assert status == 0, log[-6000:]
    assert f"exchange ok on {nproc} ranks" in log
