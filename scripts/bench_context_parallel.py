"""Context parallelism on the debug model: saved activations per rank, step time and the
bytes CP moves per layer, for cp 1 / 2 / 4 and both methods, side by side.

    python scripts/bench_context_parallel.py                  # Llama 3 debug, seq 2048, 4 gloo ranks
    python scripts/bench_context_parallel.py --flavor debug_small --seq 512 --rounds 3

One torchrun launch of 4 ranks runs every layout, interleaved round by round, so that
all of them see the same machine load: cp 1 (every rank runs the unsharded model),
cp 2 (two CP groups of 2) and cp 4, each with `allgather` and `alltoall`. All layouts
see the same batch (1 x seq tokens), fp32.

Columns:
- saved: activation bytes kept for backward on the worst rank (`SavedActivationCounter`
  around the forward and the loss: autograd's saved tensors, deduplicated by storage;
  parameters and the RoPE table excluded); ratio: saved / saved at cp 1; target: the
  issue's bound 1/cp + (gathered K/V bytes) / (saved at cp 1), met when ratio <= 1.1 x target;
- step: median seconds of forward + backward over the rounds (no optimizer step);
- per layer: bytes one rank puts on the wire per layer, measured by counting the CP
  collectives' payloads (`comm_recorder`), forward / backward, next to the formula.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LAYOUTS = [(1, "none"), (2, "allgather"), (2, "alltoall"), (4, "allgather"), (4, "alltoall")]


def formula(cp: int, method: str, a, b: int, s: int, esize: int) -> tuple[str, float]:
    """Bytes per rank per layer (one direction) and the formula, for Llama args `a`."""
    hq, hkv, d = a.n_heads, a.n_kv_heads or a.n_heads, a.dim // a.n_heads
    f = (cp - 1) / cp
    if method == "allgather":
        return "(cp-1)/cp*B*S*Hkv*2D*e", f * b * s * hkv * 2 * d * esize
    from parallelisms.context_parallel import kv_repeat_for_alltoall

    hkv_sent = hkv * kv_repeat_for_alltoall(hq, hkv, cp)
    return "(cp-1)/cp*B*S/cp*(2Hq+2Hkv')*D*e", f * b * (s // cp) * (2 * hq + 2 * hkv_sent) * d * esize


# ---------------------------------------------------------------------------
# Worker (one of 4 ranks)
# ---------------------------------------------------------------------------

def _worker(opts) -> int:
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from models import MODEL_SPECS
    from parallelisms.ac_measure import SavedActivationCounter
    from parallelisms.apply import build_model
    from parallelisms.context_parallel import apply_context_parallel, shard_microbatch
    from parallelisms.context_parallel_comm import comm_recorder

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    spec = MODEL_SPECS["llama3"]
    args = spec.flavors[opts.flavor]
    base = build_model(spec, args, "cpu")
    with torch.no_grad():
        base.init_weights(buffer_device=torch.device("cpu"))
    tokens = torch.randint(0, args.vocab_size, (1, opts.seq + 1), generator=torch.Generator().manual_seed(1))
    meshes = {cp: init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))["cp"] for cp in (2, 4)}

    runs = {}
    for cp, method in LAYOUTS:
        model = copy.deepcopy(base)
        if cp > 1:
            apply_context_parallel(model, meshes[cp], method)
            inputs, labels = shard_microbatch(tokens[:, :-1], tokens[:, 1:], meshes[cp])
        else:
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
        runs[(cp, method)] = {"model": model, "inputs": inputs, "labels": labels, "times": []}

    def step(run, measure: bool):
        model = run["model"]
        exclude = list(model.parameters()) + list(model.buffers())
        with SavedActivationCounter(exclude) as counter, comm_recorder() as fwd:
            logits = model(run["inputs"])
            loss = F.cross_entropy(logits.flatten(0, 1), run["labels"].flatten(), reduction="sum")
        with comm_recorder() as bwd:
            loss.backward()
        model.zero_grad(set_to_none=True)
        if measure:
            run["saved"], run["fwd"], run["bwd"] = counter.total_bytes, fwd.wire_bytes(), bwd.wire_bytes()

    for r in range(opts.rounds + 1):  # round 0 warms up (and measures bytes)
        for key, run in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(run, measure=r == 0)
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if r > 0:
                run["times"].append(float(dt))
    out = []
    for (cp, method), run in runs.items():
        vals = torch.tensor([run["saved"], run["fwd"], run["bwd"]], dtype=torch.float64)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        out.append({"cp": cp, "method": method, "saved": int(vals[0]), "fwd": float(vals[1]), "bwd": float(vals[2]),
                    "step": statistics.median(run["times"])})
    if rank == 0:
        Path(opts.out).write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="debug", help="Llama 3 flavor (default: debug)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.worker:
        return _worker(opts)
    from models import MODEL_SPECS

    a = MODEL_SPECS["llama3"].flavors[opts.flavor]
    if opts.seq % 8:
        print(f"--seq: {opts.seq} is not a multiple of 2 x cp = 8; use a multiple of 8", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               str(Path(__file__).resolve()), "--worker", "--out", str(out), "--flavor", opts.flavor,
               "--seq", str(opts.seq), "--rounds", str(opts.rounds)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        rows = json.loads(out.read_text())
    hkv = a.n_kv_heads or a.n_heads
    esize = 4
    gathered_kv = 1 * hkv * opts.seq * 2 * (a.dim // a.n_heads) * esize * a.n_layers  # every layer's K and V
    base = next(r for r in rows if r["cp"] == 1)
    print(f"Llama 3 {opts.flavor}: {a.n_layers} layers, dim {a.dim}, heads {a.n_heads}/{hkv} (q/kv), seq {opts.seq}, "
          f"batch 1, fp32, 4 gloo ranks, {opts.rounds} rounds; gathered K/V (all layers) {gathered_kv / 2**20:.1f} MiB")
    print(f"{'cp':>3} {'method':<10} {'saved MiB':>10} {'ratio':>6} {'target':>7} {'ok':>3} {'step s':>7} "
          f"{'fwd/layer KiB':>14} {'bwd/layer KiB':>14} {'formula KiB':>12}  formula")
    for r in rows:
        cp = r["cp"]
        ratio = r["saved"] / base["saved"]
        target = 1 / cp + (gathered_kv / base["saved"] if r["method"] == "allgather" else 0)
        ok = "yes" if ratio <= 1.1 * target else "NO"
        if cp == 1:
            text, value = "-", 0.0
        else:
            text, value = formula(cp, r["method"], a, 1, opts.seq, esize)
        print(f"{cp:>3} {r['method']:<10} {r['saved'] / 2**20:>10.2f} {ratio:>6.3f} {target:>7.3f} {ok:>3} "
              f"{r['step']:>7.3f} {r['fwd'] / a.n_layers / 1024:>14.1f} {r['bwd'] / a.n_layers / 1024:>14.1f} "
              f"{value / 1024:>12.1f}  {text}")
    return 0


if __name__ == "__main__":
    from trainer.distributed import exit_process
    exit_process(main())
