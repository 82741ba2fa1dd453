"""Host rows on the critical path of host-resident STEM tables, with and without a GPU tier.

With host tables, micro-batch 0 of step ``i + 1`` cannot start before every row it reads that step
``i`` touched has been stepped on the CPU and fetched to the GPU (no stale reads). A GPU tier that
holds the hottest rows (with their optimizer state, stepped on the GPU) takes those rows off that
path. This counts, CPU only, per training step:

* ``distinct_rows``: rows the step touches (every micro-batch, deduplicated);
* ``hit_rate``: share of the step's tokens whose row is in the GPU tier;
* ``critical_rows``: host rows micro-batch 0 reads that the previous step touched (what it waits
  for); ``critical_rows_host_only`` is the same count without a GPU tier;
* ``host_rows_fetched`` / ``host_bytes_to_gpu``: host rows fetched (each micro-batch's distinct
  host rows) and their bytes in bf16; ``host_rows_stepped`` / ``host_bytes_to_host``: distinct
  host rows with gradients per step and their fp32 gradient bytes.

The tier is chosen from the token counts of the data (``megatron_ext.stem.runtime.hot_rows``): the main
job's corpus counts its own indexed dataset; the Zipf(``--zipf``) stream counts a separate draw
of the same distribution (the tier is chosen from data the steps do not see). Batches are
consecutive windows of ``--micro-batches`` x ``--tokens`` ids; the corpus is first cut into
sequences of ``--shuffle-seq`` ids, shuffled as Megatron's GPT dataset shuffles its samples.

    .venv/bin/python benchmarks/stem_critical_path.py          # corpus of launch/main_job.py + Zipf
    .venv/bin/python benchmarks/stem_critical_path.py --sources zipf

The last line is one JSON object: ``{source: {tier fraction: {...}}}``. Goal: with a 10% tier,
``critical_rows`` at most 1/10 of ``critical_rows_host_only`` on the Zipf stream.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import corpus  # noqa: E402


def zipf_stream(vocab: int, tokens: int, exponent: float, seed: int) -> torch.Tensor:
    """``tokens`` ids with P(id = r) proportional to (r + 1)^-exponent (id 0 most frequent)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** exponent
    return torch.from_numpy(rng.choice(vocab, size=tokens, p=p / p.sum()).astype(np.int64))


def critical_path(stream: torch.Tensor, hot: torch.Tensor, micro_batches: int, tokens: int,
                  d_ff: int) -> dict:
    """Per-step means over the steps of ``stream`` (``hot``: boolean ``[vocab]``)."""
    per_step = micro_batches * tokens
    steps = stream.numel() // per_step
    if steps < 2:
        raise ValueError(f"{stream.numel()} tokens make fewer than two steps of {per_step}")
    batches = stream[: steps * per_step].view(steps, micro_batches, tokens)
    vocab = hot.numel()
    totals = {k: 0.0 for k in ("distinct_rows", "hit_rate", "critical_rows",
                               "critical_rows_host_only", "host_rows_fetched",
                               "host_rows_stepped")}
    previous = None
    counted = 0
    for step in batches:
        touched = torch.zeros(vocab, dtype=torch.bool)
        touched[step.reshape(-1)] = True
        if previous is not None:
            first = torch.unique(step[0])
            waits = first[previous[first]]
            totals["critical_rows_host_only"] += waits.numel()
            totals["critical_rows"] += int((~hot[waits]).sum())
            totals["distinct_rows"] += int(touched.sum())
            totals["hit_rate"] += float(hot[step.reshape(-1)].float().mean())
            totals["host_rows_fetched"] += sum(int((~hot[torch.unique(mb)]).sum()) for mb in step)
            totals["host_rows_stepped"] += int((touched & ~hot).sum())
            counted += 1
        previous = touched
    out = {k: v / counted for k, v in totals.items()}
    out["host_bytes_to_gpu"] = out["host_rows_fetched"] * d_ff * 2
    out["host_bytes_to_host"] = out["host_rows_stepped"] * d_ff * 4
    out["steps"] = counted
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", default="corpus,zipf", help="comma list of corpus, zipf")
    parser.add_argument("--data-prefix", default=os.path.join(
        ROOT, "runs", "main", "data", "corpus_text_document"))
    parser.add_argument("--corpus-vocab", type=int, default=None,
                        help="table rows for the corpus (default: its manifest's vocab size)")
    parser.add_argument("--vocab", type=int, default=128256, help="Zipf stream's vocabulary")
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--zipf-steps", type=int, default=60)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="ids per micro-batch")
    parser.add_argument("--tiers", default="0,0.01,0.05,0.1,0.2",
                        help="GPU tier sizes as fractions of the vocabulary")
    parser.add_argument("--d-ff", type=int, default=8192, help="row width, for bytes")
    parser.add_argument("--shuffle-seq", type=int, default=512,
                        help="corpus: cut it into sequences of this length and shuffle them, as "
                             "Megatron's GPT dataset does (0: consecutive windows)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from megatron_ext.stem.runtime import hot_rows

    tiers = [float(t) for t in args.tiers.split(",")]
    results = {}
    for source in args.sources.split(","):
        if source == "corpus":
            stream, vocab = corpus(args.data_prefix, args.corpus_vocab)
            if args.shuffle_seq:
                n = stream.numel() // args.shuffle_seq
                order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
                stream = stream[: n * args.shuffle_seq].view(n, -1)[order].reshape(-1)
            counts = hot_rows.token_counts([args.data_prefix], vocab)
            label = f"corpus {args.data_prefix} ({stream.numel():,} tokens, vocab {vocab})"
        elif source == "zipf":
            vocab = args.vocab
            n = args.zipf_steps * args.micro_batches * args.tokens
            stream = zipf_stream(vocab, n, args.zipf, seed=0)
            counts = torch.bincount(zipf_stream(vocab, n, args.zipf, seed=1), minlength=vocab)
            label = f"Zipf({args.zipf}) over {vocab:,} ids ({n:,} tokens)"
        else:
            raise SystemExit(f"--sources: unknown {source!r}")
        print(f"{label}: {args.micro_batches} micro-batches of {args.tokens} ids per step")
        print(f"  {'tier':>6} {'rows':>7} {'distinct':>9} {'hit rate':>9} {'critical':>9} "
              f"{'host-only':>9} {'host rows in':>12} {'MiB to GPU':>10} {'MiB to host':>11}")
        results[source] = {}
        for tier in tiers:
            rows = hot_rows.parse_tier_size(tier, vocab)
            r = critical_path(stream, hot_rows.hot_mask(counts, rows, vocab), args.micro_batches,
                              args.tokens, args.d_ff)
            r["tier_rows"] = rows
            results[source][str(tier)] = r
            print(f"  {100 * tier:5.0f}% {rows:7d} {r['distinct_rows']:9.0f} "
                  f"{r['hit_rate']:9.3f} {r['critical_rows']:9.1f} "
                  f"{r['critical_rows_host_only']:9.1f} {r['host_rows_fetched']:12.0f} "
                  f"{r['host_bytes_to_gpu'] / 2**20:10.1f} {r['host_bytes_to_host'] / 2**20:11.1f}")
    if "zipf" in results and "0.1" in results["zipf"]:
        r = results["zipf"]["0.1"]
        ratio = r["critical_rows"] / max(r["critical_rows_host_only"], 1e-9)
        print(f"goal (Zipf, 10% tier): critical rows at most 1/10 of the host-only design's: "
              f"{r['critical_rows']:.1f} / {r['critical_rows_host_only']:.1f} = {ratio:.3f} "
              f"({'met' if ratio <= 0.1 else 'NOT met'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
