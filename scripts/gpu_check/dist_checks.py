"""Sections on a one-rank process group (NCCL on CUDA, gloo with --dry): the paths no test
reaches because CPU CI has no NCCL and no fused CUDA optimizer. Each destroys its process
group before it exits (`common.one_rank_group`).

- fsdp: NCCL's reduce-scatter as FSDP2 calls it (on one rank FSDP2 copies instead, torch
  2.13's `foreach_reduce`, so it is called here directly); fused AdamW over DTensors
  (Shard(0), Replicate) against plain tensors, bitwise, without host syncs; then the
  trainer with FSDP2 on a one-rank mesh, AC none and op, their numbers held against each
  other (`numbers.judge`): with bf16 params and fp32 reduce (no autocast), and with fp32
  params (TF32), op SAC's replayed forward and direct recompute in both (on CUDA attention outputs);
  and fused AdamW's `found_inf`: 1 leaves params and moments bitwise unchanged, 0 takes the
  step a plain fused AdamW takes, bitwise.
- ep_mesh: DeepSeek 16B shape, one MoE layer, compile + op AC, with the experts on a
  one-rank EP mesh: the dispatcher's all-to-alls, DTensor experts and the compiled op-level
  policy as an EP run has them, with AC_TRACE=1 for what the policy decided.

The trainer builds FSDP only for dp_shard > 1 and EP only for ep > 1, so these sections
install a ParallelDims subclass (`_install_dims`) and, for EP, a copy of the model spec;
nothing else about the run is changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile

from gpu_check.common import count_syncs, device, generator, one_rank_group, randn, reason, tf32

import torch


def _install_dims(cls) -> None:
    """Makes the trainer build `cls` (a ParallelDims subclass) instead of ParallelDims."""
    from parallelisms.parallel_dims import ParallelDims

    base = ParallelDims.from_config.__func__
    ParallelDims.from_config = classmethod(lambda _cls, cfg, world: base(cls, cfg, world))


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------
# fsdp
# ---------------------------------------------------------------------------

def _reduce_scatter(rows, dev, backend: str) -> None:
    """`dist.reduce_scatter_single` as FSDP2 calls it, fp32 and bf16; on NCCL also with
    PREMUL_SUM (what FSDP2 uses to scale gradients by its divide factor at world > 1)."""
    import torch.distributed as dist

    gen = generator(dev)
    cases = [(torch.float32, dist.ReduceOp.SUM, 1.0), (torch.bfloat16, dist.ReduceOp.SUM, 1.0)]
    if backend == "nccl":
        cases.append((torch.float32, dist.ReduceOp.PREMUL_SUM(0.5), 0.5))
    got = []
    try:
        for dtype, op, factor in cases:
            inp = randn(1 << 20, dev=dev, gen=gen, dtype=dtype)
            out = torch.empty_like(inp)
            dist.reduce_scatter_single(output=out, input=inp, op=op)
            got.append(torch.equal(out, inp * factor))
    except Exception as e:  # noqa: BLE001
        rows.emit({"config": f"reduce-scatter ({backend})", "result": f"FAILED: {reason(e)}"})
        return
    ops = "SUM fp32, SUM bf16" + (", PREMUL_SUM(0.5) fp32" if len(cases) > 2 else "")
    rows.emit({"config": f"reduce-scatter ({backend}, one rank): {ops}",
               "result": f"{'ok' if all(got) else 'MISMATCH'}: output equals input x factor, bitwise: {got}"})


def _fused_adamw(rows, dev, dry: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from trainer.optim import OptimizerConfig, build_optimizer

    mesh = init_device_mesh(dev.type, (1,), mesh_dim_names=("ep",))
    shapes = [(64, 32), (96,), (8, 16, 16)] if dry else [(4096, 4096), (4096,), (64, 2048, 1408)]
    placements = [[Shard(0)], [Replicate()], [Shard(0)]]
    gen = generator(dev)
    init = [randn(*s, dev=dev, gen=gen) for s in shapes]
    plain = [torch.nn.Parameter(t.clone()) for t in init]
    dts = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, p)) for t, p in zip(init, placements)]
    cfg = OptimizerConfig(implementation="fused")
    config = f"fused AdamW, {len(shapes)} params (Shard(0), Replicate) on a one-rank mesh vs plain tensors"
    try:
        # build_optimizer takes a model part: each list stands in as a ParameterList.
        opts = [build_optimizer(torch.nn.ParameterList(ps), cfg, dev.type) for ps in (plain, dts)]
        syncs = []
        for _ in range(3):
            grads = [randn(*s, dev=dev, gen=gen) for s in shapes]
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
    rows.emit({"config": config, "syncs/step": "/".join(map(str, syncs)) + f" ({box['how']})",
               "result": f"{'ok' if equal and moved else 'MISMATCH'}: 3 steps, DTensor params equal plain ones "
                         f"bitwise: {equal}, moved: {moved}"})


def _install_one_rank_fsdp() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from parallelisms.parallel_dims import ParallelDims

    class OneRankFSDPDims(ParallelDims):
        """One rank, and yet FSDP2 over a "dp_shard" mesh of size 1."""

        def build_mesh(self, device_type: str):
            mesh = super().build_mesh(device_type)
            self._one_rank_fsdp = init_device_mesh(device_type, (1,), mesh_dim_names=("dp_shard",))
            return mesh

        def fsdp_mesh(self):
            return self._one_rank_fsdp

    _install_dims(OneRankFSDPDims)


def _found_inf(trainer) -> dict:
    """One more forward + backward, then the trainer's on-device skip (`StepGuard.step_on_device`)
    with found_inf = 1 (params, moments and step counts must stay bitwise) and = 0 (the step
    must equal a plain fused AdamW's from the same state and gradients, bitwise)."""
    from torch.distributed.tensor import DTensor

    from parallelisms.grad_reduce import settle_gradient_placements

    (opt,) = trainer.optimizers
    group = opt.param_groups[0]
    params = [p for g in opt.param_groups for p in g["params"]]
    batches = trainer.next_microbatches()
    opt.zero_grad(set_to_none=True)
    with trainer.train_context(trainer.count_global_tokens(batches)):
        trainer.forward_backward(batches)
    settle_gradient_placements(params)

    def snapshot():
        return [(_full(p.detach()).clone(), {k: _full(v).clone() for k, v in opt.state.get(p, {}).items()})
                for p in params]

    before = snapshot()
    flag = torch.ones((), device=trainer.device)
    trainer.guard.step_on_device(trainer.optimizers, flag)
    after_skip = snapshot()
    skipped = all(torch.equal(a, b) and all(torch.equal(sa[k], sb[k]) for k in sa)
                  for (a, sa), (b, sb) in zip(before, after_skip))
    del after_skip  # 8B-shape copies: params and moments, ~18 GB at 2 layers
    # The reference: a plain fused AdamW on full copies, from the same state and gradients.
    ref_params = [torch.nn.Parameter(p0.clone()) for p0, _ in before]
    ref = torch.optim.AdamW(ref_params, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                            weight_decay=group["weight_decay"], fused=True)
    for rp, p, (_, state) in zip(ref_params, params, before):
        rp.grad = _full(p.grad).clone()
        ref.state[rp] = state  # the snapshot's own copies: read by nothing else after this
    trainer.guard.step_on_device(trainer.optimizers, flag.zero_())
    ref.step()
    taken = all(torch.equal(_full(p.detach()), rp.detach()) for p, rp in zip(params, ref_params))
    moved = all(not torch.equal(_full(p.detach()), p0) for p, (p0, _) in zip(params, before))
    steps = sorted({float(opt.state[p]["step"]) for p in params})
    dtensors = all(isinstance(p, DTensor) for p in params)
    return {"skipped": skipped, "taken": taken, "moved": moved, "steps": steps, "dtensors": dtensors,
            "dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params} |
                             {"grads " + str(p.grad.dtype).replace("torch.", "") for p in params})}


def _compute_dtype(trainer) -> dict:
    """Records the dtype the first block's weights have while it runs (FSDP's param_dtype)."""
    block = next(iter(trainer.model_parts[0].layers.values()))
    seen = {}

    def hook(module, args):
        seen.setdefault("dtype", str(next(module.parameters()).dtype).replace("torch.", ""))

    inner = getattr(block, "_checkpoint_wrapped_module", block)
    first = next(m for m in inner.modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_pre_hook(hook)
    return seen


# (params, AC mode): bf16 params as multi-GPU runs train (FSDP's mixed precision, no autocast);
# fp32 params with TF32 matmuls, at seq 4096 to stay cheap. op SAC's direct recompute runs in
# both (it was refused under bf16 FSDP until its steps could read the block's arguments).
_FSDP_ROWS = (("bf16", "none"), ("bf16", "op"), ("fp32", "none"), ("fp32", "op"))


def _fsdp_trainers(rows, dev, dry: bool, backend: str) -> None:
    from gpu_check.bench import LAYERS, measure, numbers_entry, trainer_args

    _install_one_rank_fsdp()
    n_layers = LAYERS[0]
    for params, mode in _FSDP_ROWS:
        precision = "bf16 params / fp32 reduce" if params == "bf16" else "fp32 params, TF32"
        config = f"FSDP2 one rank ({backend}), {precision}, fused AdamW, AC {mode}, {n_layers} layers"
        extra = ["--activation_checkpoint.mode", mode, "--optimizer.implementation", "fused"]
        if params == "fp32":
            extra += ["--training.mixed_precision_param", "float32"] + ([] if dry else ["--training.seq_len", "4096"])
        seen: dict = {}
        try:
            with tempfile.TemporaryDirectory() as dump, tf32() if params == "fp32" else contextlib.nullcontext():
                m = measure(trainer_args(dry, "llama3", n_layers, dump, extra), dev, rows, config,
                            f"{n_layers} layers", estimate=False, inspect=lambda t: seen.update(compute=_compute_dtype(t)),
                            finish=_found_inf if (params, mode) == _FSDP_ROWS[0] else None)
        except Exception as e:  # noqa: BLE001
            rows.emit({"config": config, "result": f"FAILED during {rows.phase or 'setup'}: {reason(e)}"})
            continue
        compute = seen["compute"].get("dtype", "?")
        result = f"ok: compute in {compute}"
        f = m.get("finish")
        if f is not None:
            ok = f["skipped"] and f["taken"] and f["moved"] and f["dtensors"]
            result = (f"{'ok' if ok else 'MISMATCH'}: found_inf 1 left params and moments bitwise: {f['skipped']}; "
                      f"found_inf 0 equals plain fused AdamW bitwise: {f['taken']} (moved: {f['moved']}, step "
                      f"counts {f['steps']}); params DTensor: {f['dtensors']} ({', '.join(f['dtypes'])}), compute in "
                      f"{compute}")
        rows.emit({"config": config, "tokens/s (32L)": f"{m['tokens'] / m['step_s']:,.0f} ({n_layers}L)",
                   "syncs/step": m["syncs"],
                   "numbers": numbers_entry(f"fsdp {params}", f"FSDP2 {params}, AC none", {f"{n_layers} layers": m["run"]},
                                            reference=mode == "none", float8=False),
                   "result": result + (f"; {m['ac']}" if m["ac"] else "")})


def run_fsdp(rows, dry: bool) -> None:
    dev = device(dry)
    with one_rank_group(dev) as backend:
        _reduce_scatter(rows, dev, backend)
        _fused_adamw(rows, dev, dry)
        _fsdp_trainers(rows, dev, dry, backend)


# ---------------------------------------------------------------------------
# ep_mesh
# ---------------------------------------------------------------------------

class _TraceLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("AC_TRACE"):
            self.lines.append(message)


def _install_one_rank_ep() -> None:
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

    _install_dims(OneRankEPDims)
    spec = get_model_spec("deepseek_v3")
    register_model_spec(dataclasses.replace(
        spec, expert_parallel_fn=lambda part, dims, _cfg: apply_expert_parallel(part, dims.mesh("ep"), None)))


def run_ep_mesh(rows, dry: bool) -> None:
    from gpu_check.bench import measure, trainer_args
    from models.common.moe import MoE
    from parallelisms.expert_parallel import ExpertParallelDispatcher

    dev = device(dry)
    config = "1 MoE layer, EP mesh of 1, compile on, AC op, for-loop AdamW"
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
        with one_rank_group(dev) as backend:
            config += f" ({backend})"
            _install_one_rank_ep()
            with tempfile.TemporaryDirectory() as dump:
                # for-loop AdamW: the experts are DTensors and, with no FSDP on one rank, the dense
                # params are not (a real EP layout shards them too); foreach/fused refuse the mix.
                m = measure(trainer_args(dry, "deepseek_v3", 1, dump, ["--activation_checkpoint.mode", "op",
                                                                       "--compile.enable", "true",
                                                                       "--optimizer.implementation", "for-loop"],
                                         n_dense_layers=0),
                            dev, rows, config, "1 MoE layer", estimate=False, inspect=inspect)
    except Exception as e:  # noqa: BLE001
        rows.emit({"config": config, "result": f"FAILED during {rows.phase or 'setup'}: {reason(e)}"})
        return
    verdicts = {v: sum(line.split()[1] == v for line in trace.lines) for v in ("SAVE", "RECOMPUTE", "SKIP")}
    a2a_saved = any(line.startswith("AC_TRACE SAVE _c10d_functional.all_to_all_single") for line in trace.lines)
    target = seen.get("moe", 0) + 1  # the split sizes per MoE layer per forward, one read per step
    ok = seen.get("ep") == seen.get("moe", -1) > 0 and a2a_saved and m["loss_finite"]
    rows.emit({"config": config, "tokens/s (32L)": f"{m['tokens'] / m['step_s']:,.0f} (1L)",
               "alloc GiB": f"{m['alloc'] / 2**30:.2f}",
               "reserved GiB": "n/a" if m["reserved"] is None else f"{m['reserved'] / 2**30:.2f}",
               "syncs/step": f"{m['syncs']}; target {target}",
               "result": f"{'ok' if ok else 'FAILED'}: {seen.get('ep', 0)}/{seen.get('moe', 0)} MoE layers on the EP "
                         f"dispatcher, loss finite: {m['loss_finite']}, AC_TRACE {verdicts}, all-to-all saved: "
                         f"{a2a_saved}; first step {m['first_s']:.1f} s"})
