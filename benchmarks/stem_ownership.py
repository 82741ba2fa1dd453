"""Per-rank load of vocab-sharded STEM tables: contiguous vs interleaved row ownership, and the
bytes an exchange moves with and without deduplication, on real token batches.

    .venv/bin/python benchmarks/stem_ownership.py                       # the main job's corpus
    .venv/bin/python benchmarks/stem_ownership.py --data-prefix PREFIX --vocab 50304

Batches are consecutive windows of the tokenized corpus (``--tokens`` ids per data-parallel rank and
micro-batch, ``--world`` ranks). For each scheme it prints, per rank, the share of lookups and the
mean number of distinct rows it owns per global batch (what it serves and receives gradients for),
and the max/mean imbalance; then the rows moved per rank and step with deduplication
(``uniq(B L)``, the STEM paper's Table 1 accounting) against one row per token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import corpus  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-prefix", default=os.path.join(
        ROOT, "runs", "main", "data", "corpus_text_document"))
    parser.add_argument("--vocab", type=int, default=None,
                        help="table rows (default: the data-prep manifest's vocab size)")
    parser.add_argument("--tokens", type=int, default=4096,
                        help="token ids per rank and micro-batch")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--d-ff", type=int, default=5632, help="row width, for bytes")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from megatron_ext.stem.runtime.ownership import SCHEMES, RowOwnership, load_per_rank

    tokens, vocab = corpus(args.data_prefix, args.vocab)
    print(f"corpus {args.data_prefix}: {tokens.numel():,} tokens, vocab {vocab}")
    results = []
    for world in args.worlds:
        per_batch = args.tokens * world
        n = tokens.numel() // per_batch
        batches = tokens[: n * per_batch].view(n, per_batch)
        for scheme in SCHEMES:
            load = load_per_rank(RowOwnership(vocab, world, scheme), batches)
            results.append(load)
            print(f"  world {world} {scheme:11s}: unique rows/rank/batch "
                  f"{' '.join(f'{u:7.1f}' for u in load['unique_rows'])}  imbalance "
                  f"{load['imbalance']:.3f} (lookups {load['lookup_imbalance']:.3f})")
        # Rows each rank fetches per micro-batch: its batch's distinct ids vs one per token.
        local = batches.view(n, world, args.tokens)
        uniq = torch.tensor([[torch.unique(r).numel() for r in b] for b in local]).double()
        mean_uniq = float(uniq.mean())
        row_bytes = 4 * args.d_ff
        results.append({"world": world, "rows_per_rank_dedup": mean_uniq,
                        "rows_per_rank_no_dedup": args.tokens,
                        "bytes_ratio": args.tokens / mean_uniq})
        print(f"  world {world}: rows fetched per rank and micro-batch {mean_uniq:.0f} deduplicated "
              f"vs {args.tokens} ({args.tokens / mean_uniq:.2f}x fewer bytes; "
              f"{mean_uniq * row_bytes / 2**20:.1f} MiB vs {args.tokens * row_bytes / 2**20:.1f} "
              f"MiB fp32 at d_ff={args.d_ff})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
