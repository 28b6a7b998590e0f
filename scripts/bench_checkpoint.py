"""Cost of checkpoint integrity: the CRC32 manifest at save, the verification at load, per GB.

    python scripts/bench_checkpoint.py [--gib 1] [--rounds 3] [--folder /path/on/the/checkpoint/disk]

Writes a DCP checkpoint of `--gib` GiB of fp32 tensors, then times, interleaved per round:
the DCP save itself, the checksum pass (trainer/checkpoint_files.checksum_files, what every
rank does over its own files before the commit), and the verification (verify_files, what
a load does before DCP reads). Reads come from the page cache right after a write, as at
commit time; a cold load also pays the disk read, which DCP's own load pays anyway.
Prints one table (medians over rounds, seconds and seconds per GiB).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer import checkpoint_files as files  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args()
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    n_tensors = 16
    numel = int(args.gib * 2**30 / 4 / n_tensors)
    state = {"model": {f"w{i}": torch.randn(numel) for i in range(n_tensors)}}
    gib = n_tensors * numel * 4 / 2**30
    root = Path(args.folder or tempfile.mkdtemp(prefix="bench_ckpt_"))
    times: dict[str, list[float]] = {"DCP save": [], "checksum (manifest)": [], "verify (load)": []}
    try:
        for r in range(args.rounds):
            path = root / f"round{r}"
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=str(path))
            times["DCP save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            manifest = {"files": files.checksum_files(files.rank_files(path, 0))}
            times["checksum (manifest)"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            problem = files.verify_files(path, manifest, sorted(manifest["files"]))
            times["verify (load)"].append(time.perf_counter() - t0)
            assert problem is None, problem
            shutil.rmtree(path)
    finally:
        if args.folder is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"checkpoint of {gib:.2f} GiB, {args.rounds} rounds, {torch.get_num_threads()} threads, "
          f"CRC32 in {files.BLOCK_BYTES >> 20} MiB blocks")
    print(f"{'phase':<22}{'median s':>10}{'s / GiB':>10}{'vs save':>10}")
    save = statistics.median(times["DCP save"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<22}{m:>10.3f}{m / gib:>10.3f}{m / save:>9.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
