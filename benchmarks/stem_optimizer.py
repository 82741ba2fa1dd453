"""CPU optimizer throughput for STEM table rows: the ``sparse`` row-wise AdamW on a batch's touched
rows against DeepSpeed's dense CPU Adam on a tensor of the same size, in one run.

    .venv/bin/python benchmarks/stem_optimizer.py            # vocab 50304, d_ff 5632, 8192 tokens

Touched rows come from Zipf-distributed token ids (as in text); the table has been stepped a few
times before timing, so most touched rows are first brought up to date from an earlier iteration
(the sparse step's catch-up, fused into its pass over each row). Reports updated parameters per
second and the ratio sparse / dense (goal: at least 0.8x), the share of touched rows that owed a
catch-up and the step of the same rows again at once (none owing; but the rows are now in the
caches, so the difference is not the catch-up alone: on contiguous rows out of the caches the
fused catch-up costs about 3%, docs/benchmarks.md), plus the dense optimizer over the whole table.
DeepSpeed's rate is measured twice: on one window reused at every repetition (the goal's baseline
until 2026-11-26), which the host's last-level cache can partly hold, and on a window that moves on
through a table-sized state at every repetition, as DeepSpeed's dense step in training walks a
shard that no cache holds (its rate there is printed beside, from the step over the whole table).
The repetitions reuse their tensors, as both optimizers do in training (``--fresh-buffers``: new
ones at each repetition, as this benchmark did before 2026-11-26). The table, the moments and
DeepSpeed's tensors are allocated as the tables' store allocates host rows: on transparent huge
pages (``megatron_ext/stem/runtime/host_memory.py``; ``--no-huge-pages``: ordinary pages, as before
2026-11-26, eleventh session).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--d-ff", type=int, default=5632)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--kernel", choices=["auto", "rowwise", "torch"],
                        default="auto", help="sparse kernel (auto: rowwise when it builds)")
    parser.add_argument("--fresh-buffers", action="store_true",
                        help="allocate the gradients and DeepSpeed's tensors anew at each "
                             "repetition (the benchmark before 2026-11-26; with --no-huge-pages "
                             "as it was then) instead of reusing them")
    parser.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                        help="host tensors on transparent huge pages, as the store allocates "
                             "them (default); --no-huge-pages: ordinary 4 KiB pages")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from megatron_ext.stem.runtime import host_memory
    from megatron_ext.stem.runtime.row_adam import (
        DEEPSPEED_OPTIMIZER_ID,
        AdamHyper,
        RowAdamW,
        deepspeed_op,
    )

    if deepspeed_op() is None:
        raise SystemExit("DeepSpeed's cpu_adam op is not available: nothing to compare against")
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, args.vocab + 1, dtype=torch.float64)

    def batch_rows():
        ids = torch.multinomial(1.0 / ranks, args.tokens, replacement=True, generator=g)
        return torch.unique(ids)

    huge = args.huge_pages

    def host_randn(rows: int) -> torch.Tensor:
        return host_memory.empty((rows, args.d_ff), huge=huge).normal_(generator=g)

    table = host_randn(args.vocab)
    sparse = RowAdamW([table], mode="sparse", kernel=args.kernel, huge_pages=huge)
    for _ in range(3):  # varied step counts and owed decay
        rows = batch_rows()
        sparse.step([(rows, torch.randn(rows.numel(), args.d_ff, generator=g))], hyper)

    # Both optimizers keep their tensors from step to step in training (the table and its moments;
    # DeepSpeed's parameters and moments; the gradients land in reused staging buffers), so the
    # repetitions reuse theirs: views of buffers sized for the most rows a batch can touch.
    # --fresh-buffers allocates them anew at each repetition instead (this benchmark before
    # 2026-11-26): on a 2-core VM that churn of ~300 MB of fresh pages per repetition slowed the
    # sparse step after it by about a third, while DeepSpeed's step, on pages it had just
    # touched, was not slowed (docs/benchmarks.md).
    op = deepspeed_op()
    if not args.fresh_buffers:
        most = min(args.tokens, args.vocab)
        grad_buf = torch.empty(most, args.d_ff)
        same_buf = host_randn(most)
        dense_buf = RowAdamW([same_buf], mode="dense", kernel="deepspeed", huge_pages=huge)
        dense_buf.step([(torch.arange(most), grad_buf.normal_(generator=g))], hyper)
    # DeepSpeed again, on a window of a table-sized state that moves on at every repetition, so
    # that, where that state is larger than the caches (3.4 GB at the default shape), no window
    # is in them when it is stepped: in training DeepSpeed's dense step walks the whole shard.
    # The window above is reused, and the host's last-level cache can hold much of it. The sparse
    # rows are a mix: the hottest were stepped at the previous repetition, the tail comes from
    # memory.
    cold_rows = args.vocab  # as large as the table: a window comes back after ~vocab / rows
    cold_state = [host_randn(cold_rows) for _ in range(3)]
    cold_state[2].abs_()  # a second moment is never negative
    cold_next = 0

    def deepspeed_seconds(params, grad, exp_avg, exp_avg_sq) -> float:
        """One timed step of DeepSpeed's dense CPU Adam on these tensors."""
        t0 = time.perf_counter()
        op.adam_update(DEEPSPEED_OPTIMIZER_ID, 2, hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
                       hyper.weight_decay, True, params, grad, exp_avg, exp_avg_sq)
        return time.perf_counter() - t0

    sparse_times, sparse_params, owing, again_times = [], [], [], []
    dense_times, cold_times = [], []
    for _ in range(args.reps):
        rows = batch_rows()
        n = rows.numel()
        if args.fresh_buffers:
            grad = torch.randn(n, args.d_ff, generator=g)
        else:
            grad = grad_buf[:n].normal_(generator=g)
        owing.append(float((sparse.lazy.last[0][rows] < sparse.lazy.clock.step).float().mean()))
        t0 = time.perf_counter()
        sparse.step([(rows, grad)], hyper)
        sparse_times.append(time.perf_counter() - t0)
        sparse_params.append(n * args.d_ff)
        # The same rows stepped again at once: none owes a catch-up (an upper bound on what the
        # catch-up costs: the rows are in the caches now).
        t0 = time.perf_counter()
        sparse.step([(rows, grad)], hyper)
        again_times.append(time.perf_counter() - t0)
        # DeepSpeed's dense CPU Adam on a tensor with as many parameters.
        if args.fresh_buffers:
            same = host_randn(n)
            dense = RowAdamW([same], mode="dense", kernel="deepspeed", huge_pages=huge)
            dense.step([(torch.arange(n), grad)], hyper)  # first step allocates the grad buffer
            state = (same, dense.exp_avg[0], dense.exp_avg_sq[0])
        else:
            state = (same_buf[:n], dense_buf.exp_avg[0][:n], dense_buf.exp_avg_sq[0][:n])
        dense_times.append(deepspeed_seconds(state[0], grad, state[1], state[2]))
        if cold_next + n > cold_rows:
            cold_next = 0
        window = [t[cold_next:cold_next + n] for t in cold_state]
        cold_next += n
        cold_times.append(deepspeed_seconds(window[0], grad, window[1], window[2]))
    del cold_state, window
    # What --stem-optimizer dense does each iteration: DeepSpeed's Adam over every owned row.
    on_huge = host_memory.huge_bytes([table, *sparse.exp_avg, *sparse.exp_avg_sq])
    whole = RowAdamW([table], mode="dense", kernel="deepspeed", huge_pages=huge)
    rows = batch_rows()
    grad = torch.randn(rows.numel(), args.d_ff, generator=g)
    whole.step([(rows, grad)], hyper)
    t0 = time.perf_counter()
    whole.step([(rows, grad)], hyper)
    whole_s = time.perf_counter() - t0
    del whole
    sparse_rate = statistics.median(p / t for p, t in zip(sparse_params, sparse_times))
    dense_rate = statistics.median(p / t for p, t in zip(sparse_params, dense_times))
    cold_rate = statistics.median(p / t for p, t in zip(sparse_params, cold_times))
    summary = {"vocab": args.vocab, "d_ff": args.d_ff, "tokens": args.tokens,
               "touched_rows": int(statistics.median(p // args.d_ff for p in sparse_params)),
               "threads": torch.get_num_threads(), "fresh_buffers": args.fresh_buffers,
               "huge_pages": huge, "sparse_state_bytes_on_huge_pages": on_huge,
               "transparent_huge_pages": host_memory.thp_setting(),
               "sparse_params_per_s": sparse_rate, "deepspeed_dense_params_per_s": dense_rate,
               "ratio": sparse_rate / dense_rate,
               "deepspeed_dense_cold_params_per_s": cold_rate,
               "ratio_cold": sparse_rate / cold_rate,
               "sparse_step_s": statistics.median(sparse_times),
               "rows_owing_catch_up": statistics.median(owing),
               "sparse_step_no_catch_up_s": statistics.median(again_times),
               "dense_whole_table_step_s": whole_s,
               "dense_whole_table_params_per_s": table.numel() / whole_s}
    print(f"STEM CPU optimizer | vocab {args.vocab} d_ff {args.d_ff}, {args.tokens} tokens -> "
          f"~{summary['touched_rows']} touched rows | {summary['threads']} threads")
    state = 3 * table.numel() * table.element_size()
    pages = (f"{(on_huge or 0) / 2**30:.2f} of {state / 2**30:.2f} GiB of the sparse state on "
             f"huge pages (transparent huge pages: {summary['transparent_huge_pages']})"
             if huge else "ordinary pages (--no-huge-pages)")
    print(f"  host tensors: {pages}")
    summary["kernel"] = sparse.kernel
    print(f"  sparse row-wise AdamW      : {sparse_rate / 1e9:.3f} G params/s ({sparse.kernel})")
    print(f"  DeepSpeed CPU Adam (dense) : {dense_rate / 1e9:.3f} G params/s (same size)")
    print(f"  ratio                      : {summary['ratio']:.3f}x (goal >= 0.8x)")
    print(f"  DeepSpeed, moving window   : {cold_rate / 1e9:.3f} G params/s (same size, in a "
          f"table-sized state, as training walks it) -> ratio {summary['ratio_cold']:.3f}x")
    again_ms = summary["sparse_step_no_catch_up_s"] * 1e3
    print(f"  catch-up: {100 * summary['rows_owing_catch_up']:.0f}% of the touched rows owe one; "
          f"the same rows stepped again (none owing, now in the caches) {again_ms:.1f} ms vs "
          f"{summary['sparse_step_s'] * 1e3:.1f} ms")
    print(f"  per iteration: sparse {summary['sparse_step_s'] * 1e3:.1f} ms vs dense over the "
          f"whole {args.vocab} x {args.d_ff} table {whole_s * 1e3:.1f} ms "
          f"({whole_s / summary['sparse_step_s']:.1f}x; DeepSpeed's rate there "
          f"{summary['dense_whole_table_params_per_s'] / 1e9:.3f} G params/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
