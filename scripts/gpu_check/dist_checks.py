"""Sections on a one-rank process group (NCCL on CUDA, gloo with --dry): the paths no test
reaches because CPU CI has no NCCL and no fused CUDA optimizer.

- fused_adamw: the trainer's fused AdamW over DTensors (Shard(0) and Replicate on a one-rank
  mesh) must equal it over plain tensors bitwise, and run without host syncs.
- ep_mesh: DeepSeek 16B shape, 2 layers (1 dense + 1 MoE), compile + op AC, with the MoE's
  experts on a one-rank EP mesh: the dispatcher's all-to-alls, DTensor experts and the
  compiled op-level policy as an EP run has them, with AC_TRACE=1 for what the policy decided.
  The trainer only builds EP for ep > 1, so this section installs the dispatcher itself
  (`OneRankEPDims` and a copy of the model spec); nothing else about the run is changed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile

from gpu_check.common import count_syncs, device, one_rank_group, reason

import torch


def run_fused_adamw(rows, dry: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from trainer.optim import OptimizerConfig, build_optimizer

    dev = device(dry)
    one_rank_group(dev)
    mesh = init_device_mesh(dev.type, (1,), mesh_dim_names=("ep",))
    shapes = [(64, 32), (96,), (8, 16, 16)] if dry else [(4096, 4096), (4096,), (64, 2048, 1408)]
    placements = [[Shard(0)], [Replicate()], [Shard(0)]]
    g = torch.Generator(device="cpu").manual_seed(0)
    init = [torch.randn(*s, generator=g).to(dev) for s in shapes]
    plain = [torch.nn.Parameter(t.clone()) for t in init]
    dts = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, p)) for t, p in zip(init, placements)]
    cfg = OptimizerConfig(implementation="fused")
    config = f"fused AdamW, {len(shapes)} params (Shard(0), Replicate) on a one-rank mesh vs plain tensors"
    try:
        # build_optimizer takes a model part: each list stands in as a ParameterList.
        opts = [build_optimizer(torch.nn.ParameterList(ps), cfg, dev.type) for ps in (plain, dts)]
        syncs = []
        for _ in range(3):
            grads = [torch.randn(*s, generator=g).to(dev) for s in shapes]
            for p, d, gr, pl in zip(plain, dts, grads, placements):
                p.grad = gr.clone()
                d.grad = distribute_tensor(gr.clone(), mesh, pl)
            opts[0].step()
            with count_syncs(dev) as box:
                opts[1].step()
            syncs.append(box["n"])
        equal = all(torch.equal(p.detach(), d.detach().full_tensor()) for p, d in zip(plain, dts))
        moved = all(not torch.equal(p.detach(), t) for p, t in zip(plain, init))
    except Exception as e:  # noqa: BLE001
        rows.emit({"config": config, "result": f"FAILED: {reason(e)}"})
        return
    ok = equal and moved
    rows.emit({"config": config, "syncs/step": "/".join(map(str, syncs)) + f" ({box['how']})",
               "result": f"{'ok' if ok else 'MISMATCH'}: 3 steps, DTensor params equal plain ones bitwise: {equal}"})


class _TraceLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("AC_TRACE"):
            self.lines.append(message)


def _install_one_rank_ep(dev: torch.device) -> None:
    """Makes the trainer put DeepSeek's routed experts on a one-rank "ep" mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from models import get_model_spec, register_model_spec
    from parallelisms.expert_parallel import apply_expert_parallel
    from parallelisms.parallel_dims import ParallelDims

    class OneRankEPDims(ParallelDims):
        """One rank, and yet an "ep" mesh (of size 1) for the experts."""

        @property
        def ep_enabled(self) -> bool:
            return True

        def build_mesh(self, device_type: str):
            mesh = super().build_mesh(device_type)
            self.expert_meshes = {"ep": init_device_mesh(device_type, (1,), mesh_dim_names=("ep",))}
            return mesh

        def mesh(self, name: str):
            return self.expert_meshes.get("ep") if name == "ep" else super().mesh(name)

    base = ParallelDims.from_config.__func__
    ParallelDims.from_config = classmethod(lambda cls, cfg, world: base(OneRankEPDims, cfg, world))
    spec = get_model_spec("deepseek_v3")
    register_model_spec(dataclasses.replace(
        spec, expert_parallel_fn=lambda part, dims, _cfg: apply_expert_parallel(part, dims.mesh("ep"), None)))


def run_ep_mesh(rows, dry: bool) -> None:
    from gpu_check.bench import measure, trainer_args
    from models.common.moe import MoE
    from parallelisms.expert_parallel import ExpertParallelDispatcher

    dev = device(dry)
    config = "1 dense + 1 MoE layer, EP mesh of 1, compile on, AC op, for-loop AdamW"
    os.environ["AC_TRACE"] = "1"
    trace = _TraceLines()
    logging.getLogger("ac").addHandler(trace)
    logging.getLogger("ac").setLevel(logging.INFO)
    seen = {}

    def inspect(trainer):
        moes = [m for part in trainer.model_parts for m in part.modules() if isinstance(m, MoE)]
        seen["moe"] = len(moes)
        seen["ep"] = sum(isinstance(m.token_dispatcher, ExpertParallelDispatcher) for m in moes)

    try:
        backend = one_rank_group(dev)
        _install_one_rank_ep(dev)
        with tempfile.TemporaryDirectory() as dump:
            # for-loop AdamW: the experts are DTensors and, with no FSDP on one rank, the dense
            # params are not (a real EP layout shards them too); foreach/fused refuse the mix.
            m = measure(trainer_args(dry, "deepseek_v3", 2, dump, ["--activation_checkpoint.mode", "op",
                                                                   "--compile.enable", "true",
                                                                   "--optimizer.implementation", "for-loop"]),
                        dev, rows, config, "2 layers", estimate=False, inspect=inspect)
    except Exception as e:  # noqa: BLE001
        rows.emit({"config": config, "result": f"FAILED during {rows.phase or 'setup'}: {reason(e)}"})
        return
    verdicts = {v: sum(line.split()[1] == v for line in trace.lines) for v in ("SAVE", "RECOMPUTE", "SKIP")}
    a2a_saved = any(line.startswith("AC_TRACE SAVE _c10d_functional.all_to_all_single") for line in trace.lines)
    target = seen.get("moe", 0) + 1  # the split sizes per MoE layer per forward, one read per step
    ok = seen.get("ep") == seen.get("moe", -1) > 0 and a2a_saved and m["loss_finite"]
    rows.emit({"config": f"{config} ({backend})", "tokens/s (32L)": f"{m['tokens'] / m['step_s']:,.0f} (2L)",
               "alloc GiB": f"{m['alloc'] / 2**30:.2f}",
               "reserved GiB": "n/a" if m["reserved"] is None else f"{m['reserved'] / 2**30:.2f}",
               "syncs/step": f"{m['syncs']}; target {target}",
               "result": f"{'ok' if ok else 'FAILED'}: {seen.get('ep', 0)}/{seen.get('moe', 0)} MoE layers on the EP "
                         f"dispatcher, loss finite: {m['loss_finite']}, AC_TRACE {verdicts}, all-to-all saved: "
                         f"{a2a_saved}; first step {m['first_s']:.1f} s"})
