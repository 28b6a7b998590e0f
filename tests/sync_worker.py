"""Counts host reads of one MoE forward + backward under EP with op-level AC (a one-rank gloo
EP mesh, so the real dispatcher runs); prints {"forward": {...}, "backward": {...}} as JSON.
With `compile`: the same model compiled (aot_eager, MoE blocks woven) under op AC in this
fresh process, against eager without AC; prints the losses and the worst grad difference.

    python -m tests.sync_worker PORT [compile]

Run in a subprocess by tests/test_cuda_paths.py (it initialises a process group).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

aten = torch.ops.aten
# Ops whose CUDA kernels read the device from the host (their output size or a scalar).
SYNC_OPS = {aten._local_scalar_dense.default: "item", aten.nonzero.default: "nonzero",
            aten.masked_select.default: "masked_select", aten.bincount.default: "bincount",
            aten._unique2.default: "unique"}


class HostReads(TorchDispatchMode):
    """Counts, per phase, the host reads a CUDA run would do: `.tolist()` (not dispatched on
    CPU, so patched), `.item()` / nonzero / masked_select / unique / bincount, boolean indexing,
    and `repeat_interleave` with device repeats and no output_size (it syncs in the kernel)."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.counts: dict[str, Counter] = {"forward": Counter(), "backward": Counter()}
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        mode = self

        def tolist(t):
            mode.counts[mode.phase]["tolist"] += 1
            return mode._tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = SYNC_OPS.get(func)
        if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
            if kwargs.get("output_size") is None and (len(args) < 3 or args[-1] is None):
                name = "repeat_interleave without output_size"
        if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            name = "boolean index"
        if name is not None:
            self.counts[self.phase][name] += 1
        return func(*args, **(kwargs or {}))


def _ep_model(mesh, mode: str, compiled: bool):
    from models import get_model_spec
    from parallelisms.activation_checkpoint import ActivationCheckpointConfig, apply_activation_checkpointing
    from parallelisms.apply import build_model
    from parallelisms.compile import CompileConfig, apply_compile
    from parallelisms.expert_parallel import apply_expert_parallel
    from tests.ep_worker import EP_TEST

    spec = get_model_spec("deepseek_v3")
    torch.manual_seed(0)
    model = build_model(spec, EP_TEST, "cpu")
    model.init_weights()
    n_moe = apply_expert_parallel(model, mesh)
    ac = ActivationCheckpointConfig(mode=mode)
    if mode != "none":
        apply_activation_checkpointing(model, ac, spec=spec)
    if compiled:
        apply_compile(model, CompileConfig(enable=True, backend="aot_eager"), ac)
    return model, n_moe


def compiled_vs_eager(mesh) -> dict:
    """One step of the compiled op-AC EP model (the first compiled call of every piece: the
    forward compiles, the op-AC recompute reruns the compiled pieces) against eager without AC."""
    from tests.ep_worker import EP_TEST

    tokens = torch.randint(0, EP_TEST.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    got = {}
    for name, mode, compiled in (("eager", "none", False), ("compiled", "op", True)):
        model, _ = _ep_model(mesh, mode, compiled)
        loss = model(tokens).float().square().mean()
        loss.backward()
        grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for n, p in model.named_parameters()}
        got[name] = (loss.item(), {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in grads.items()})
    (le, ge), (lc, gc) = got["eager"], got["compiled"]
    assert ge.keys() == gc.keys(), sorted(ge.keys() ^ gc.keys())
    worst = max(((gc[n] - ge[n]).abs().max() / ge[n].abs().max().clamp_min(1e-12)).item() for n in ge)
    return {"loss_eager": le, "loss_compiled": lc, "grads": len(ge), "max_grad_rel": worst}


def main(port: int, what: str = "syncs") -> None:
    from tests.ep_worker import EP_TEST
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
        if what == "compile":
            print(json.dumps(compiled_vs_eager(mesh)))
            return
        model, n_moe = _ep_model(mesh, "op", compiled=False)
        tokens = torch.randint(0, EP_TEST.vocab_size, (2, 32))
        with HostReads() as reads:
            out = model(tokens)
            loss = out.float().square().mean()
            reads.phase = "backward"
            loss.backward()
        print(json.dumps({"moe_layers": n_moe, **{k: dict(v) for k, v in reads.counts.items()}}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from trainer.distributed import exit_process
    main(int(sys.argv[1]), *sys.argv[2:])
    exit_process(0)
