"""Row fetch and gradient push between data-parallel ranks (gloo, 2 and 3 ranks): fetched rows equal
the global table's, pushed gradients arrive summed at their owners, for contiguous and interleaved
ownership and for replicated tables; routing on the host group, nothing exchanged with one rank.
The checks run inside ``tests/dist/stem_exchange_check.py``; the tokens' host copy on every TP rank
in ``tests/dist/host_tokens_check.py``."""

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


def test_host_tokens_reach_every_tensor_parallel_rank():
    """TP=2 x DP=2: every TP rank gets the tokens' host copy (what STEM routes without waiting
    for the GPU) over the gloo copy of its TP group, equal to the batch's tokens."""
    status, log = launch_ranks([os.path.join(ROOT, "tests", "dist", "host_tokens_check.py")], 4,
                               timeout=300)
    assert status == 0, log[-6000:]
    assert "host tokens ok on every TP rank" in log
