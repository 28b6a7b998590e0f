"""Data pipeline figures: reader start-up, RSS and windows/s at 10^6, 10^7, 10^8 tokens, against
what the debug model's training step consumes; tokenizer throughput per worker.

    python scripts/bench_data.py                      # sizes 1e6 1e7 1e8, seq 256, batch 4 (llama_debug.toml)
    python scripts/bench_data.py --sizes 1e6 1e9 --batches 500

Token folders are written straight into the shard format (random tokens, documents of
100..2000 tokens) so that 10^8 tokens take seconds to make; the tokenizer is measured
separately on generated jsonl text. Each reader measurement runs in a fresh process, so
its start-up time and RSS are its own; sizes are measured in interleaved rounds.
Start-up = opening the folder, building the stream and producing the first batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TOKENIZER = str(REPO / "assets" / "tokenizer" / "tokenizer.model")


def _rss_mib(field: str = "VmRSS") -> float:
    """VmRSS (all resident pages, including memory-mapped file pages the page cache can drop)
    or RssAnon (the process's own memory)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_token_folder(folder: Path, num_tokens: int, shard_tokens: int = 1 << 25) -> None:
    """A finished token folder of `num_tokens` random tokens, written with the real writer and manifest."""
    import numpy as np

    from trainer.data.pretokenize import job_config
    from trainer.data.shards import FORMAT, MANIFEST, VERSION, ShardWriter, tokenizer_hash, write_json_atomic
    from trainer.data.tokenizer import build_tokenizer

    if (folder / MANIFEST).exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    tok = build_tokenizer(TOKENIZER)
    rng = np.random.default_rng(0)
    shards, left, k = [], num_tokens, 0
    while left > 0:
        n = min(left, shard_tokens)
        writer = ShardWriter(str(folder), k, np.uint16)
        lengths = rng.integers(100, 2000, size=n // 100 + 2)
        lengths = lengths[:np.searchsorted(np.cumsum(lengths), n) + 1]
        lengths[-1] -= lengths.sum() - n
        writer.add(rng.integers(0, tok.vocab_size, size=n, dtype=np.uint16), lengths)
        shards.append(writer.finish())
        left, k = left - n, k + 1
    write_json_atomic(str(folder / MANIFEST), {
        "format": FORMAT, "version": VERSION, "dtype": "uint16",
        "job": job_config([], [], TOKENIZER, tok, "text", None, shard_tokens, 0),
        "tokenizer": {"sha256": tokenizer_hash(TOKENIZER), "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
                      "eos_id": tok.eos_id, "path": TOKENIZER},
        "source": {"inputs": ["bench_data.py random tokens"]}, "shards": shards, "tokens": num_tokens,
        "docs": sum(s["docs"] for s in shards), "skipped_records": 0})


def child_reader(folder: str, seq_len: int, batch: int, batches: int) -> dict:
    from trainer.data import DataConfig, build_dataloader, build_tokenizer  # imports torch, before the clock

    rss0 = _rss_mib()  # after imports (torch), before the data
    t0 = time.perf_counter()
    loader = build_dataloader(DataConfig(type="tokens", path=folder), tokenizer=build_tokenizer(TOKENIZER),
                              tokenizer_path=TOKENIZER, seq_len=seq_len, local_batch_size=batch, dp_rank=0,
                              dp_world_size=1, seed=0)
    it = iter(loader)
    next(it)
    startup = time.perf_counter() - t0
    rss_start = _rss_mib()
    t1 = time.perf_counter()
    for _ in range(batches):
        next(it)
    secs = time.perf_counter() - t1
    return {"startup_s": startup, "rss_base_mib": rss0, "rss_startup_mib": rss_start, "rss_end_mib": _rss_mib(),
            "anon_end_mib": _rss_mib("RssAnon"), "windows_per_s": batches * batch / secs}


def child_step(seq_len: int, batch: int, steps: int) -> dict:
    from scripts.bench_train import trainer_step

    step, _ = trainer_step(["--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch)], "none")
    for _ in range(2):  # warm-up
        step()
    return {"step_s": statistics.median(step()[0] for _ in range(steps))}


def _child(args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, cwd=REPO)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"child {args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(line[7:])


def tokenizer_throughput(root: Path, workers_list: list[int], mbytes: int) -> list[dict]:
    from trainer.data.pretokenize import tokenize_to_shards

    words = "the of and to in is that for it as was with be by on not he this are or from at which".split()
    src = root / "text.jsonl"
    if not src.exists():
        rng = random.Random(0)
        with open(src, "w") as f:
            while f.tell() < mbytes << 20:
                f.write(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(50, 800)))}) + "\n")
    out = []
    for w in workers_list:
        dst = root / f"tok_w{w}"
        shutil.rmtree(dst, ignore_errors=True)
        t0 = time.perf_counter()
        m = tokenize_to_shards([str(src)], str(dst), TOKENIZER, workers=w, progress_bar=False)
        secs = time.perf_counter() - t0
        out.append({"workers": w, "tokens": m["tokens"], "secs": secs, "tokens_per_s": m["tokens"] / secs,
                    "per_worker": m["tokens"] / secs / w, "mb_per_s": os.path.getsize(src) / secs / 2**20})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["1e6", "1e7", "1e8"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--batches", type=int, default=2000, help="batches read per reader measurement")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--step-steps", type=int, default=12, help="training steps timed for the debug model")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="tokenizer worker counts")
    p.add_argument("--text-mb", type=int, default=16, help="jsonl text for the tokenizer measurement")
    p.add_argument("--root", default="/tmp/titanlite_bench_data")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, *rest = args.child
        res = (child_reader(rest[0], args.seq_len, args.batch, args.batches) if kind == "reader"
               else child_step(args.seq_len, args.batch, args.step_steps))
        print("RESULT " + json.dumps(res))
        return
    root = Path(args.root)
    sizes = [int(float(s)) for s in args.sizes]
    for n in sizes:
        make_token_folder(root / f"tokens_{n}", n)
    common = ["--seq-len", str(args.seq_len), "--batch", str(args.batch), "--batches", str(args.batches)]
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    steps = []
    for _ in range(args.rounds):  # interleaved: every round measures every size and the training step
        for n in sizes:
            runs[n].append(_child([*common, "--child", "reader", str(root / f"tokens_{n}")]))
        steps.append(_child(["--seq-len", str(args.seq_len), "--batch", str(args.batch), "--step-steps",
                             str(args.step_steps), "--child", "step"])["step_s"])
    step = min(steps)
    consumed = args.batch / step
    print(f"reader: seq_len {args.seq_len}, batch {args.batch}, {args.batches} batches per run, best of "
          f"{args.rounds} interleaved rounds; RSS includes torch (base = after imports)")
    print("| tokens | start-up s | RSS base MiB | RSS after start-up MiB | RSS after reading MiB | "
          "anonymous RSS after reading MiB | windows/s | x training step |")
    print("|---|---|---|---|---|---|---|---|")
    for n in sizes:
        r = runs[n]
        wps = max(x["windows_per_s"] for x in r)
        print(f"| {n:.0e} | {min(x['startup_s'] for x in r):.3f} | {min(x['rss_base_mib'] for x in r):.0f} | "
              f"{min(x['rss_startup_mib'] for x in r):.0f} | {min(x['rss_end_mib'] for x in r):.0f} | "
              f"{min(x['anon_end_mib'] for x in r):.0f} | {wps:,.0f} | "
              f"{wps / consumed:,.0f}x |")
    print(f"debug model training step (llama_debug.toml, seq {args.seq_len}, batch {args.batch}, 1 rank): "
          f"{step:.3f} s/step = {consumed:.1f} windows/s consumed")
    print("| tokenizer workers | tokens | s | tokens/s | tokens/s per worker | input MB/s |")
    print("|---|---|---|---|---|---|")
    for r in tokenizer_throughput(root, args.workers, args.text_mb):
        print(f"| {r['workers']} | {r['tokens']:,} | {r['secs']:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{r['per_worker']:,.0f} | {r['mb_per_s']:.1f} |")


if __name__ == "__main__":
    main()
