"""Row fetch and gradient push between data-parallel ranks (gloo, 2 and 3 ranks): fetched rows equal
the global table's, pushed gradients arrive summed at their owners, for contiguous and interleaved
ownership and for replicated tables. The checks run inside ``tests/dist/stem_exchange_check.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_ext.compat.standalone import free_port
from multirank import ROOT

SCRIPT = os.path.join(ROOT, "tests", "dist", "stem_exchange_check.py")


@pytest.mark.parametrize("nproc", [2, 3])
def test_exchange(nproc):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
         f"--master_port={free_port()}", SCRIPT],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"exchange ok on {nproc} ranks" in proc.stdout
