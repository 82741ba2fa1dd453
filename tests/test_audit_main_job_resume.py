"""launch/main_job.py run twice: a finished run is read, not trained again; a run stopped
part-way resumes from its checkpoint; a run with other settings starts over. The job used to
save no checkpoint and retrain both runs from scratch every time (about 9 minutes on 2 cores).
No training here: the run folders are made by hand as the job and Megatron leave them."""

import json
import os

from tests_helpers import load_script

main_job = load_script("launch/main_job.py", "main_job_resume_under_test")

FLAGS = ["--train-iters", "8", "--seed", "1"]


def make_run(run_dir, flags=FLAGS, tracker=None, iters=(), starts=(0,), complete=False):
    """A run folder: its record, checkpoint folders ``iters`` and the tracker's text."""
    ckpt = run_dir / "ckpt"
    ckpt.mkdir(parents=True)
    for it in iters:
        (ckpt / f"iter_{it:07d}").mkdir()
    if tracker is not None:
        (ckpt / "latest_checkpointed_iteration.txt").write_text(str(tracker))
    (run_dir / "tensorboard").mkdir()
    (run_dir / "run.json").write_text(json.dumps(
        {"flags": list(flags), "starts": list(starts), "wall_s": 12.5, "complete": complete}))


def test_the_megatron_flags_save_and_resume_from_the_runs_folder():
    flags = main_job.megatron_flags(200, 1, ["--mock-data"], "/o/tb", "/o/cache", "/o/run/ckpt")
    pairs = dict(zip(flags, flags[1:]))
    assert pairs["--save"] == pairs["--load"] == "/o/run/ckpt"
    assert pairs["--save-interval"] == "50" and pairs["--ckpt-format"] == "torch_dist"
    assert "--save" not in main_job.megatron_flags(200, 1, [], "/o/tb", "/o/cache")


def test_a_finished_run_is_read_not_trained_again(tmp_path):
    run = tmp_path / "dense"
    make_run(run, tracker=8, iters=(8,), complete=True)
    state, record = main_job.plan_run(str(run), FLAGS, 8)
    assert state == "done" and record["wall_s"] == 12.5 and (run / "ckpt").is_dir()


def test_a_run_stopped_part_way_resumes_from_its_last_complete_checkpoint(tmp_path):
    run = tmp_path / "dense"
    # iter 6 is a save that stopped part-way: the tracker still names 4
    make_run(run, tracker=4, iters=(2, 4, 6))
    state, record = main_job.plan_run(str(run), FLAGS, 8)
    assert state == "resume" and record["starts"] == [0]
    assert main_job.checkpoint_iteration(str(run / "ckpt")) == 4
    assert (run / "tensorboard").is_dir()  # the curves before the stop are kept


def test_other_settings_or_no_checkpoint_start_over(tmp_path, capsys):
    run = tmp_path / "dense"
    make_run(run, tracker=8, iters=(8,), complete=True)
    state, record = main_job.plan_run(str(run), ["--train-iters", "9", "--seed", "1"], 9)
    assert state == "fresh" and not run.exists() and record["starts"] == []
    assert "dense: training from scratch (its settings changed)" in capsys.readouterr().out
    # stopped before its first checkpoint; or a folder of the job before it saved checkpoints
    make_run(run, tracker=None)
    assert main_job.plan_run(str(run), FLAGS, 8)[0] == "fresh" and not run.exists()
    (run / "tensorboard").mkdir(parents=True)
    assert main_job.plan_run(str(run), FLAGS, 8)[0] == "fresh" and not run.exists()


def test_only_the_last_checkpoint_of_a_finished_run_is_kept(tmp_path):
    run = tmp_path / "dense"
    make_run(run, tracker=8, iters=(2, 4, 6, 8))
    main_job.drop_older_checkpoints(str(run / "ckpt"))
    assert sorted(os.listdir(run / "ckpt")) == ["iter_0000008", "latest_checkpointed_iteration.txt"]


def test_step_times_leave_out_the_warm_up_of_every_start():
    skip = main_job.TRAIN["timing_skip_iters"]
    iters = 20
    # 9 s at the first iterations of each launch (warm-up), 1 s otherwise
    starts = [0, 10]
    times = [(s, 9.0 if any(b < s <= b + skip for b in starts) else 1.0)
             for s in range(1, iters + 1)]
    scalars = {"lm loss": [(s, 5.0) for s in range(1, iters + 1)],
               "lm loss validation": [(iters, 4.0)], "iteration-time": times}
    m = main_job.run_metrics("dense", scalars, iters, 2048, starts)
    assert m["seconds_per_iter"] == 1.0 and m["seconds_per_iter_median"] == 1.0
    # counted as one launch, the resumed warm-up is in the mean
    assert main_job.run_metrics("dense", scalars, iters, 2048)["seconds_per_iter"] > 1.0
