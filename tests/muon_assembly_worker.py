"""Muon's assembly on 4 gloo ranks: who orthogonalises what, and the results.

    python -m torch.distributed.run --nproc-per-node 4 tests/muon_assembly_worker.py OUT_DIR

Linear layers under TP (column-wise: TP Shard(0), FSDP's _StridedShard over it; row-wise:
FSDP Shard(0) x TP Shard(1)) with even shapes (4 matrices per layout) and uneven ones (3
matrices of 7 x 5 and 6 x 7: uneven chunks on both the stack and the matrix dims). Each
rank writes OUT_DIR/rank<r>.json, per mesh ("fsdp_tp"; "hsdp": FSDP2's HSDP, replicate 2 x
shard 2; "replicate": the same weights replicated over all 4 ranks as DTensors): the matrices
and NS FLOPs its `fn` received, per matrix shape, and the largest difference of its result
shards from NS of the whole matrix on one rank (taken through the same layout). Then the
grouping: four params on two equal but distinct mesh objects, which must make one stack (one
`fn` call per rank); and a 3-row matrix over dp 2 then tp 2, and 1-row ones under HSDP, which
leave a rank an empty shard.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.memory import LiveBytesTracker  # noqa: E402
from trainer.memory.optimizer_terms import _muon_step  # noqa: E402
from trainer.memory.rank_facts import matrix_layout  # noqa: E402
from trainer.muon import newton_schulz, ns_flops, ns_temporaries  # noqa: E402

# name -> (out, in, plan); the weight is [out, in]
LAYERS = {**{f"col{k}": (12, 8, "col") for k in range(4)}, **{f"row{k}": (8, 12, "row") for k in range(4)},
          **{f"colu{k}": (7, 5, "col") for k in range(3)}, **{f"rowu{k}": (6, 7, "row") for k in range(3)}}
STEPS = 5


def build(weights: dict, mesh, plan: str) -> torch.nn.Module:
    """The LAYERS with these weights: "fsdp_tp" (TP plans on mesh["tp"], FSDP on mesh["dp"]),
    "hsdp" (FSDP2 on the 2-D mesh: replicate x shard) or "replicate" (Replicate DTensors on a 1-D mesh)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = torch.nn.Module()
    for name, (o, i, _) in LAYERS.items():
        model.add_module(name, torch.nn.Linear(i, o, bias=False))
    with torch.no_grad():
        for name, w in weights.items():
            model.get_submodule(name).weight.copy_(w)
    if plan == "replicate":
        for name in LAYERS:
            lin = model.get_submodule(name)
            lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Replicate()]))
        return model
    if plan == "fsdp_tp":
        parallelize_module(model, mesh["tp"], {name: ColwiseParallel() if kind == "col" else RowwiseParallel()
                                               for name, (_, _, kind) in LAYERS.items()})
        mesh = mesh["dp"]
    for name in LAYERS:
        fully_shard(model.get_submodule(name), mesh=mesh)
    return model


def run(params: list, updates: list, fn, out: list | None = None) -> list:
    """This rank's result shard for each of `params`, given its update shards `updates`: copied
    into `out` (tensors shaped like `updates`) where given, as Muon adds each to its weight and
    keeps none; else the results themselves."""
    from parallelisms.muon_assembly import orthogonalize

    kept: list = [None] * len(params)
    orthogonalize(params, updates.__getitem__, fn, (lambda i, o: out[i].copy_(o)) if out else kept.__setitem__,
                  torch.float32, temporaries=ns_temporaries)
    return out or kept


def counted(meshes: dict, updates: dict, ns) -> dict:
    """Per mesh: the matrices and NS FLOPs this rank's `fn` received, per matrix shape, and the
    largest difference of its result shards from NS of each whole matrix on one rank."""
    want_full = {n: ns(u[None])[0] for n, u in updates.items()}  # NS of each whole matrix, one rank's math
    result = {}
    for plan, mesh in meshes.items():
        given, want = build(updates, mesh, plan), build(want_full, mesh, plan)
        params = [given.get_submodule(n).weight for n in LAYERS]
        assert all(torch.equal(p.full_tensor(), updates[n]) for n, p in zip(LAYERS, params))
        received: dict[str, list[int]] = {}

        def counting(x: torch.Tensor) -> torch.Tensor:
            key = "x".join(map(str, x.shape[-2:]))
            got = received.setdefault(key, [0, 0])
            got[0] += x.shape[0]
            got[1] += x.shape[0] * ns_flops(*x.shape[-2:], STEPS)
            return ns(x)

        updates_here = [p.to_local().detach().clone() for p in params]
        out = [torch.empty_like(u) for u in updates_here]
        with LiveBytesTracker([*params, *updates_here, *out]) as tracker:
            run(params, updates_here, counting, out)
        # what the estimator counts for this step (the updates exist already: no Nesterov temporary)
        predicted = _muon_step({n: matrix_layout(p) for n, p in zip(LAYERS, params)}, 4, nesterov=False)
        diffs = [(o - want.get_submodule(n).weight.to_local()).abs().max().item() for n, o in zip(LAYERS, out)]
        result[plan] = {"received": received, "err": max(diffs), "bitwise": max(diffs) == 0.0,
                        "peak_bytes": tracker.peak, "predicted_bytes": predicted,
                        "placements": {n: [str(q) for q in given.get_submodule(n).weight.placements]
                                       for n in ("col0", "row0")}}
    return result


def main(out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    torch.manual_seed(0)  # the same whole matrices on every rank
    updates = {name: torch.randn(o, i) for name, (o, i, _) in LAYERS.items()}
    ns = lambda x: newton_schulz(x, STEPS, torch.float32)  # noqa: E731
    layouts = counted({"fsdp_tp": mesh, "hsdp": hsdp, "replicate": flat}, updates, ns)

    # Equal meshes, distinct objects: one stack of 4 (one matrix, one call per rank).
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.randn(4, 8, 12)
    twins = [distribute_tensor(full[k], mesh if k < 2 else mesh2, [Shard(0), Shard(1)]) for k in range(4)]
    calls = []
    twin_out = run(twins, [t.to_local() for t in twins], lambda x: calls.append(x.shape[0]) or ns(x))
    twin_err = max((o - distribute_tensor(ns(full[k][None])[0], mesh, [Shard(0), Shard(1)]).to_local())
                   .abs().max().item() for k, o in enumerate(twin_out))

    # An empty shard: 3 rows over dp 2 then tp 2 leave rank (dp 1, tp 1) none (chunks 2, 1 -> 1, 0);
    # under HSDP, 1-row matrices leave shard rank 1 none, and 3 of them over 2 replicas x 2
    # shards leave that rank's replica chunk of the stack's matrices short too.
    empty_rows, empty_err = {}, 0.0
    for name, m, place, full in (("fsdp_tp", mesh, [Shard(0), Shard(0)], torch.randn(2, 3, 5)),
                                 ("hsdp", hsdp, [Replicate(), Shard(0)], torch.randn(3, 1, 5))):
        rows = [distribute_tensor(full[k], m, place) for k in range(len(full))]
        got = run(rows, [t.to_local() for t in rows], ns)
        want = [distribute_tensor(ns(full[k][None])[0], m, place).to_local() for k in range(len(full))]
        assert all(o.shape == w.shape for o, w in zip(got, want))
        empty_err = max(empty_err, *(((o - w).abs().max().item() if o.numel() else 0.0) for o, w in zip(got, want)))
        empty_rows[name] = rows[0].to_local().shape[0]
    result = {"layouts": layouts, "meshes_distinct": mesh2 is not mesh,
              "meshes_equal": mesh2 == mesh, "twin_calls": calls, "twin_err": twin_err,
              "empty_rows": empty_rows, "empty_err": empty_err}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
