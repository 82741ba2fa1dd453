"""``--stem-host-read direct`` in a training: the same losses and the same final tables as the
staged read, bit for bit (tiered tables, the sparse optimizer with its owed step and
catch-ups, prefetch on). On the CPU the direct read's Triton kernel runs under Triton's
interpreter (``TRITON_INTERPRET=1``, which ``tests/conftest.py`` sets without CUDA and the ranks
inherit), reading the host rows as it would over the bus; one launch of one rank holds both
trainings (``tests/multirank.py`` ``Launches``)."""

from __future__ import annotations

import glob

import pytest
import torch

from multirank import TINY_GPT, Launches, require_ok

pytestmark = pytest.mark.multirank

STEM = TINY_GPT + ["--model-family", "stem", "--stem-layers", "1,3", "--train-iters", "6",
                   "--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
                   "--stem-gpu-tier", "25%", "--stem-optimizer", "sparse"]


def test_direct_read_trains_as_the_staged_read(tmp_path):
    launches = Launches(str(tmp_path))
    for read in ("staged", "direct"):
        launches.add(read, STEM + ["--stem-host-read", read, "--stem-dump-tables",
                                   str(tmp_path / f"dump_{read}")], nproc=1)
    runs = launches.run()
    staged, direct = require_ok(runs["staged"]), require_ok(runs["direct"])
    assert len(staged.losses) == 6 and staged.losses == direct.losses
    dumps = {read: [torch.load(f) for f in sorted(glob.glob(str(tmp_path / f"dump_{read}" /
                                                                "*.pt")))]
             for read in ("staged", "direct")}
    assert len(dumps["staged"]) == len(dumps["direct"]) == 1
    (a,), (b,) = dumps["staged"][0]["chunks"], dumps["direct"][0]["chunks"]
    assert torch.equal(a["ids"], b["ids"]) and a["layers"] == b["layers"]
    for x, y in zip(a["rows"], b["rows"]):
        assert torch.equal(x, y)
