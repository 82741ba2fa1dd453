"""launch/main_job.py --repeats: the run order and how the repeats' step times combine, against
ratios worked out by hand (no training: the runs' metrics are made up here)."""

import pytest
from tests_helpers import load_script

main_job = load_script("launch/main_job.py", "main_job_under_test")


def metrics(mean, median, losses=(5.0, 4.0)):
    return {"seconds_per_iter": mean, "seconds_per_iter_median": median,
            "tokens_per_s": 2048 / mean, "wall_s": 100.0, "train_loss_first": losses[0],
            "train_loss_final": losses[-1],
            "train_loss_curve": list(enumerate(losses, 1)), "valid_loss_final": 4.5}


def test_run_order_alternates_which_runs_first():
    order = [(r, name) for r, name, _ in main_job.run_order(3)]
    assert order == [(0, "dense"), (0, "stem-1/3"), (1, "stem-1/3"), (1, "dense"),
                     (2, "dense"), (2, "stem-1/3")]
    assert [name for _, name, _ in main_job.run_order(1)] == ["dense", "stem-1/3"]
    assert "--stem-table-placement" in dict(
        (n, f) for _, n, f in main_job.run_order(1))["stem-1/3"]


def test_run_folders_keep_the_first_repeats_plain_name():
    assert main_job.run_dir_name("stem-1/3", 0) == "stem-1_3"
    assert main_job.run_dir_name("stem-1/3", 1) == "stem-1_3.repeat2"
    assert main_job.run_dir_name("dense", 2) == "dense.repeat3"


def test_ratio_is_the_median_of_each_repeats_own_ratio():
    # The machine slows down by half in repeat 2: the ratio of the pooled means would be
    # (1.1 + 2.0 + 0.9) / (1.0 + 2.0 + 1.0) = 1.0 too, but the pooled medians would not; each
    # repeat's own ratio is 1.1, 1.0, 0.9 and their median 1.0.
    per_repeat = [{"dense": metrics(1.0, 1.0), "stem-1/3": metrics(1.1, 1.2)},
                  {"stem-1/3": metrics(2.0, 3.0), "dense": metrics(2.0, 2.0)},
                  {"dense": metrics(1.0, 1.0), "stem-1/3": metrics(0.9, 0.8)}]
    combined = main_job.combine_repeats(per_repeat)
    assert list(combined) == ["dense", "stem-1/3"]
    stem, dense = combined["stem-1/3"], combined["dense"]
    assert stem["step_time_ratios"] == pytest.approx([1.1, 1.0, 0.9])
    assert stem["step_time_ratio"] == pytest.approx(1.0)
    assert stem["step_time_ratios_median"] == pytest.approx([1.2, 1.5, 0.8])
    assert stem["step_time_ratio_median"] == pytest.approx(1.2)
    assert dense["step_time_ratios"] == [1.0, 1.0, 1.0]
    assert stem["seconds_per_iter"] == pytest.approx(1.1)  # median of 1.1, 2.0, 0.9
    assert stem["seconds_per_iter_repeats"] == [1.1, 2.0, 0.9]
    assert stem["wall_s"] == 300.0 and stem["repeats"] == 3
    assert stem["loss_max_diff_repeats"] == 0.0


def test_one_repeat_gives_the_plain_ratios():
    combined = main_job.combine_repeats([{"dense": metrics(0.5, 0.4),
                                          "stem-1/3": metrics(0.55, 0.42)}])
    assert combined["stem-1/3"]["step_time_ratio"] == pytest.approx(1.1)
    assert combined["stem-1/3"]["step_time_ratio_median"] == pytest.approx(1.05)
    assert combined["stem-1/3"]["seconds_per_iter"] == 0.55


def test_a_later_repeat_with_other_losses_is_reported():
    per_repeat = [{"dense": metrics(1.0, 1.0), "stem-1/3": metrics(1.0, 1.0)},
                  {"stem-1/3": metrics(1.0, 1.0, losses=(5.0, 4.25)),
                   "dense": metrics(1.0, 1.0)}]
    combined = main_job.combine_repeats(per_repeat)
    assert combined["stem-1/3"]["loss_max_diff_repeats"] == pytest.approx(0.25)
    assert combined["dense"]["loss_max_diff_repeats"] == 0.0
    assert combined["stem-1/3"]["train_loss_curve"] == [(1, 5.0), (2, 4.0)]  # the first's


def test_table_lists_the_repeats_ratios():
    per_repeat = [{"dense": metrics(1.0, 1.0), "stem-1/3": metrics(1.1, 1.2)},
                  {"stem-1/3": metrics(2.0, 3.0), "dense": metrics(2.0, 2.0)}]
    combined = main_job.combine_repeats(per_repeat)
    for r in combined.values():
        r.update(total_params=1e6, stem_table_params=0, active_params_per_token=1e6,
                 train_flops_per_token=6e6, total_train_flops=1e9, flop_ratio=1.0,
                 proxy_roi=1.0)
    table = main_job.print_table(combined)
    assert "1.100 1.000" in table and "1.200 1.500" in table
    assert "step time vs dense (median of the repeats' ratios)" in table


def test_repeats_must_be_positive():
    with pytest.raises(SystemExit):
        main_job.parse_args(["--repeats", "0"])
    assert main_job.parse_args(["--repeats", "3"]).repeats == 3
