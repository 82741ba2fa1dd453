"""STEM tables reshard across TP sizes whose vocabulary padding differs, as Megatron's word
embeddings do: vocabulary 777 is padded to 896 rows at TP=1 and to 1024 at TP=2
(``--make-vocab-size-divisible-by 128`` times TP). A step-5 checkpoint saved at one TP size loads
at the other with its optimizer state, trains no step (``--train-iters 5``) and saves on exit, so
its table and Adam moments are the loaded ones: the rows both paddings have are the saved rows,
bit for bit, and the rows only the larger padding has are zero.

Losses are not compared across the two paddings: Megatron's output layer scores the padding rows
too (its cross entropy runs over the padded vocabulary), so a dense GPT resumed with another
padding also starts from another loss."""

from __future__ import annotations

import pytest
import torch

from multirank import (TINY_GPT, Launches, assert_teardown_left_only_the_default_group,
                       require_ok)

pytestmark = pytest.mark.multirank


def _vocab(flags, size):
    flags = list(flags)
    flags[flags.index("--vocab-size") + 1] = str(size)
    return flags


STEM = _vocab(TINY_GPT, 777) + ["--model-family", "stem", "--stem-layers", "1,3"]
CPU_VOCAB = ["--stem-table-placement", "cpu", "--stem-table-sharding", "vocab"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
SAVE5 = ["--train-iters", "5", "--save-interval", "5", "--save"]
# Load step 5 (model and optimizer), train no step, save on exit (5 is no multiple of 7).
LOAD5 = ["--ckpt-step", "5", "--train-iters", "5", "--save-interval", "7", "--load"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stem_tp_padding")
    # Two launches (tests/multirank.py, Launches): the 4-rank save, then the three 2-rank
    # trainings. The ordinary table's TP=1 save runs as DP=2 (2 micro-batches a rank; it ran as
    # one rank with 4 before, a launch of its own): the padding is TP's alone, and the same 5
    # global batches reach the same rows.
    launches = Launches(str(tmp))

    def run(name, flags, nproc):
        launches.add(name, STEM + flags, nproc=nproc)

    run("managed_tp2", CPU_VOCAB + TP2 + SAVE5 + [str(tmp / "man")], nproc=4)
    run("ordinary_tp1", SAVE5 + [str(tmp / "ord")], nproc=2)
    run("ordinary_tp2_from_tp1", TP2 + LOAD5 + [str(tmp / "ord"), "--save", str(tmp / "ord2")],
        nproc=2)
    run("managed_tp1_from_tp2", CPU_VOCAB + LOAD5 + [str(tmp / "man"), "--save",
                                                     str(tmp / "man1")], nproc=2)
    out = launches.run()
    out["tmp"] = tmp
    return out


@pytest.mark.parametrize("saved,loaded,rows_saved,rows_loaded", [
    ("ordinary_tp1", "ordinary_tp2_from_tp1", 896, 1024),
    ("managed_tp2", "managed_tp1_from_tp2", 1024, 896)])
def test_tables_reshard_across_tp_with_other_padding(runs, saved, loaded, rows_saved,
                                                     rows_loaded, mcore_single_rank):
    """The table and its Adam moments (``exp_avg``, ``exp_avg_sq``) after the load equal the
    saved ones row by row on every row both paddings have (the vocabulary's 777 and the
    smaller padding's); rows only the loaded layout's padding has are zero; rows only the saved
    one had are padding (no token reads them), dropped. The moments of padding rows are zero
    (never a gradient)."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    require_ok(runs[saved])
    new = require_ok(runs[loaded])
    assert not new.losses  # nothing trained after the load
    for rows, run in ((rows_saved, runs[saved]), (rows_loaded, new)):
        assert f"with {rows - 777} dummy tokens (new size: {rows})" in run.log
    tmp = runs["tmp"]
    directory = {"ordinary_tp1": ("ord", "ord2"), "managed_tp2": ("man", "man1")}[saved]
    before = load_plain_tensors(str(tmp / directory[0] / "iter_0000005"))
    after = load_plain_tensors(str(tmp / directory[1] / "iter_0000005"))
    common = min(rows_saved, rows_loaded)
    for layer in (1, 3):
        table = f"decoder.layers.{layer}.mlp.table"
        for key in (table, f"optimizer.state.exp_avg.{table}",
                    f"optimizer.state.exp_avg_sq.{table}"):
            a, b = before[key], after[key]
            assert a.shape == (rows_saved, 128) and b.shape == (rows_loaded, 128), key
            for row in range(common):  # row by row: a shifted or transposed layout fails here
                assert torch.equal(b[row], a[row]), (key, row)
            assert torch.count_nonzero(b[common:]) == 0, key  # new padding rows (if any)
            if key != table:
                for padded in (a, b):
                    assert torch.count_nonzero(padded[777:]) == 0, key
        # Five steps of Adam: every row of the table is non-zero; the moments of the rows the
        # mock data's tokens hit are, those of the others zero.
        assert torch.count_nonzero(before[table][:777].abs().sum(1)) == 777
        touched = torch.count_nonzero(before[f"optimizer.state.exp_avg_sq.{table}"][:777]
                                      .abs().sum(1))
        assert 0 < touched < 777


def test_teardown_frees_every_training(runs):
    """The trainings of the two launches (the ordinary table's TP=1 save and TP=2 load, managed
    tables' TP=2 save and TP=1 load) are each freed at their teardown with their process
    groups."""
    assert_teardown_left_only_the_default_group(runs)
