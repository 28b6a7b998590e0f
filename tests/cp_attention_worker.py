"""CP attention vs full attention, on real gloo ranks (one torchrun launch, many cases).

    python -m torch.distributed.run --nproc-per-node N tests/cp_attention_worker.py CASES.json OUT_DIR

Each case {"name", "method", "hq", "hkv", "dk", "dv", "seq", "scale", "ac"} builds the same
random q, k, v on every rank, runs causal attention on the full sequence (the
reference) and the CP version on this rank's head-tail shard, and rank 0 writes
OUT_DIR/<name>.json with the max relative error of the output and of dq, dk, dv
(unsharded from every rank), and the CP collectives counted in forward and backward.
`ac` = "op" runs the CP attention under the op-level SAC policy with the CP ops in
its save set, "full" under full recompute, "none" plain.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class CausalSDPA(nn.Module):
    """Stand-in for models.common.attention.SDPA (same call convention)."""

    def __init__(self, scale=None):
        super().__init__()
        self.scale = scale

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                              enable_gqa=q.shape[1] != k.shape[1])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_case(case: dict, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.checkpoint import checkpoint

    from parallelisms.activation_checkpoint import op_sac_context_fn
    from parallelisms.context_parallel import ContextParallelAttention
    from parallelisms.context_parallel_comm import CP_SAVE_OPS, comm_recorder, shard_sequence, unshard_sequence

    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(1234)
    b, s = 2, case["seq"]
    q = torch.randn(b, case["hq"], s, case["dk"], generator=gen, dtype=torch.float64)
    k = torch.randn(b, case["hkv"], s, case["dk"], generator=gen, dtype=torch.float64)
    v = torch.randn(b, case["hkv"], s, case["dv"], generator=gen, dtype=torch.float64)
    grad_out = torch.randn(b, case["hq"], s, case["dv"], generator=gen, dtype=torch.float64)
    inner = CausalSDPA(case.get("scale"))

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = inner(*ref)
    ref_out.backward(grad_out)

    local = [shard_sequence(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    attention = ContextParallelAttention(inner, mesh, case["method"])
    ac = case.get("ac", "none")
    with comm_recorder() as fwd:
        if ac == "none":
            out_local = attention(*local)
        else:
            ctx = op_sac_context_fn(extra_save_ops=CP_SAVE_OPS) if ac == "op" else None
            kwargs = {"context_fn": ctx} if ctx is not None else {}
            out_local = checkpoint(attention, *local, use_reentrant=False, **kwargs)
    with comm_recorder() as bwd:
        out_local.backward(shard_sequence(grad_out, cp, rank, dim=2))

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(cp)]
        dist.all_gather(parts, t.contiguous())
        return unshard_sequence(parts, dim=2)

    result = {"out": rel(gather(out_local.detach()), ref_out.detach())}
    for name, r, l in zip("qkv", ref, local):
        result[f"d{name}"] = rel(gather(l.grad), r.grad)
    result["fwd_calls"] = fwd.count()
    result["bwd_calls"] = {n: bwd.count(n) for n in ("all_gather", "reduce_scatter", "all_to_all")}
    result["fwd_wire_bytes"] = fwd.wire_bytes()
    if rank == 0:
        (out / f"{case['name']}.json").write_text(json.dumps(result))
    dist.barrier()


def run_model_case(case: dict, out: Path) -> None:
    """A whole model (case["model"], case["flavor"]) with the CP plan vs the same model
    unsharded: loss (token-summed, all-reduced over cp) and every parameter gradient
    (summed over cp, as FSDP over dp_shard x cp would)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from models import MODEL_SPECS
    from parallelisms.context_parallel import apply_context_parallel, shard_microbatch
    from parallelisms.context_parallel_comm import comm_recorder

    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    spec = MODEL_SPECS[case["model"]]
    torch.manual_seed(0)
    ref = spec.model_cls(spec.flavors[case["flavor"]])
    with torch.no_grad():
        ref.init_weights(buffer_device=torch.device("cpu"))
    model = copy.deepcopy(ref)
    replaced = apply_context_parallel(model, mesh, case["method"])
    if case.get("ac", "none") != "none":  # as the trainer does: the spec's save ops plus CP's
        from parallelisms.activation_checkpoint import ActivationCheckpointConfig, apply_activation_checkpointing
        from parallelisms.context_parallel import CP_SAVE_OPS

        apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=case["ac"]),
                                       extra_save_ops=spec.sac_save_ops | CP_SAVE_OPS,
                                       force_recompute_fqns=tuple(spec.sac_force_recompute_fqns))
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 2048, (2, case["seq"] + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def loss_of(m, x, y):
        logits = m(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")

    ref_loss = loss_of(ref, inputs, labels)
    ref_loss.backward()
    local_inputs, local_labels = shard_microbatch(inputs, labels, mesh)
    with comm_recorder() as fwd:
        loss = loss_of(model, local_inputs, local_labels)
    with comm_recorder() as bwd:
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    worst = 0.0
    for (name, p), (name_ref, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
        assert name.replace("_checkpoint_wrapped_module.", "") == name_ref, (name, name_ref)
        g = p.grad.clone()
        dist.all_reduce(g)
        worst = max(worst, rel(g, p_ref.grad))
    result = {"loss": abs(float(total) - float(ref_loss)) / abs(float(ref_loss)), "grad": worst,
              "replaced": replaced, "fwd_calls": fwd.count(), "fwd_wire_bytes": fwd.wire_bytes(),
              "bwd_calls": {n: bwd.count(n) for n in ("all_gather", "reduce_scatter", "all_to_all")}}
    if rank == 0:
        (out / f"{case['name']}.json").write_text(json.dumps(result))
    dist.barrier()


def main() -> int:
    from tests.helpers import run_worker_cases

    return run_worker_cases(lambda case, out: (run_model_case if "model" in case else run_case)(case, out),
                            "CP_WORKER_ONLY", timeout_s=120)


if __name__ == "__main__":
    from trainer.distributed import exit_process
    exit_process(main())
