"""Tokenize a corpus once into memory-mapped token shards for training.

    python scripts/tokenize_data.py --input /data/fineweb --output /data/fineweb-tok --workers 16

Inputs: .txt (one document per file), .jsonl / .jsonl.gz / .jsonl.zst (one JSON object per
line, text under --text-field), .parquet and .arrow (the --text-field column), a
`datasets.save_to_disk` folder (--split for a DatasetDict), or folders of any of these.
Several --input are concatenated in the order given.

The output folder (format in trainer/data/shards.py) is what `data.path` points at with
`data.type = "tokens"`. A killed run resumes when rerun with the same arguments, and gives
byte-identical output. A progress bar shows input bytes, docs/s, tokens/s and the ETA.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configuration.fields import ConfigError  # noqa: E402

DEFAULT_TOKENIZER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                                 "tokenizer", "tokenizer.model")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", action="append", required=True, help="File or folder; repeat for more.")
    p.add_argument("--output", required=True, help="Output folder (created; a partial one is resumed).")
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="Tokenizer file (model.tokenizer_path).")
    p.add_argument("--text-field", default="text", help="JSON key / column holding the text (default: text).")
    p.add_argument("--split", default=None, help="Split of a datasets DatasetDict folder (default: train).")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="Tokenizer processes (default: CPUs - 1).")
    p.add_argument("--shard-tokens", type=int, default=1 << 28, help="Tokens per shard (default 2^28).")
    p.add_argument("--chunk-chars", type=int, default=1 << 20,
                   help="Characters per work item; part of the output's identity (default 2^20).")
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")
    args = p.parse_args(argv)
    if args.workers < 1 or args.shard_tokens < 1 or args.chunk_chars < 1:
        print("error: --workers, --shard-tokens and --chunk-chars must be >= 1", file=sys.stderr)
        return 2

    from trainer.data.pretokenize import tokenize_to_shards

    try:
        m = tokenize_to_shards(args.input, args.output, args.tokenizer, text_field=args.text_field,
                               split=args.split, workers=args.workers, shard_tokens=args.shard_tokens,
                               chunk_chars=args.chunk_chars, progress_bar=not args.no_progress)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    run = m.get("_run")
    print(f"{args.output}: {m['tokens']:,} tokens, {m['docs']:,} documents in {len(m['shards'])} shards "
          f"({m['dtype']}), {m['skipped_records']:,} records without text skipped")
    if run and run["seconds"] > 0 and run["tokens"]:
        tps = run["tokens"] / run["seconds"]
        print(f"this run: {run['tokens']:,} tokens in {run['seconds']:.1f} s = {tps:,.0f} tokens/s with "
              f"{run['workers']} worker(s), {tps / run['workers']:,.0f} tokens/s per worker")
    return 0


if __name__ == "__main__":
    sys.exit(main())
