"""The one assembly path from model args to trainable, parallelized model parts.

    build_model (meta) -> [PP split] -> parallelize each part: float8 -> TP -> CP -> EP -> AC -> compile -> FSDP
                       -> materialise -> layout-independent init

The trainer, the memory estimator, the benches and the scripts all build models
here, so the order of the plans is written once. Each step is a plan applied from
outside the model by module name; the model code knows nothing about parallelism.

Why this order: float8 swaps Linear modules for torchao's Float8Linear, which every later
plan then treats as a Linear (TP shards it, FSDP sees its float8-aware weight); TP changes
parameter shapes and layouts, so it goes first; CP swaps the
attention cores (no parameters) and contributes its collectives to the AC save set; EP then
re-shards the routed experts; AC wraps whole blocks, which must already hold their
final (DTensor) parameters; compile sees the AC wrapper so that the partitioner reads
the SAC tags; FSDP goes last because it shards whatever the earlier plans produced
and hooks the outermost modules.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

logger = logging.getLogger("apply")


def build_model(spec, args, device: torch.device | str = "meta") -> nn.Module:
    """The model of `spec` with `args`, built under `device` (meta: no memory)."""
    with torch.device(device):
        return spec.model_cls(args)


@dataclass(frozen=True)
class Precision:
    """param: the dtype FSDP gathers parameters in (its compute dtype); reduce: the
    gradient reduce dtype; autocast: the compute dtype without FSDP (None = fp32)."""

    param: torch.dtype
    reduce: torch.dtype
    autocast: torch.dtype | None


def resolve_precision(training_cfg, device_type: str, fsdp_enabled: bool) -> Precision:
    """bf16 where it is fast and supported; fp32 on CPU unless mixed_precision_on_cpu.
    Without FSDP (one GPU, TP or PP alone) there is no MixedPrecisionPolicy, so autocast
    gives the same bf16 compute."""
    def pick(name: str) -> torch.dtype:
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]
        if dtype == torch.bfloat16:
            if device_type == "cpu" and not training_cfg.mixed_precision_on_cpu:
                return torch.float32
            if device_type == "cuda" and not torch.cuda.is_bf16_supported():
                return torch.float32
        return dtype

    param, reduce = pick(training_cfg.mixed_precision_param), pick(training_cfg.mixed_precision_reduce)
    autocast = None if fsdp_enabled or param == torch.float32 else param
    return Precision(param=param, reduce=reduce, autocast=autocast)


def autocast_context(precision: Precision, device_type: str):
    """bf16 autocast when `precision` asks for it (no FSDP), else a no-op."""
    if precision.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=precision.autocast)


def parallelize(part: nn.Module, spec, dims, cfg, *, precision: Precision | None = None,
                backend: str | None = None) -> nn.Module:
    """Applies float8 -> TP -> CP -> EP -> AC -> compile -> FSDP to one model part (the whole model, or one
    pipeline stage) in place and returns it. Needs `dims.build_mesh()` to have run when any
    degree is > 1."""
    device_type = dims.device_type
    precision = precision or resolve_precision(cfg.training, device_type, dims.fsdp_mesh() is not None)
    if cfg.float8.enable:
        from parallelisms.float8 import apply_float8

        apply_float8(part, cfg.float8, torch.device(device_type))
    if dims.tp_enabled:  # a spec without a TP plan is refused by parallel_dims.check_layout
        spec.tensor_parallel_fn(part, dims.mesh("tp"), cfg.parallelism)
    save_ops: frozenset = frozenset()  # a plan's own ops that op-level AC must keep
    if dims.cp > 1:
        from parallelisms.context_parallel import CP_SAVE_OPS, apply_context_parallel

        apply_context_parallel(part, dims.mesh("cp"), cfg.parallelism.context_parallel_method)
        if cfg.float8.enable:  # float8 scales over whole sequences, as one rank takes them
            from parallelisms.float8 import reduce_scales_over

            reduce_scales_over(part, dims.mesh("cp"), cfg.float8)
        save_ops = save_ops | CP_SAVE_OPS  # op SAC keeps CP's gathers: a recompute sends nothing
    if dims.ep_enabled:  # a model without routed experts or an EP plan is refused by parallel_dims.check_layout
        spec.expert_parallel_fn(part, dims, cfg.parallelism)
    if dims.dp_degree > 1:
        from parallelisms.sequence_shards import add_batch_shard_mesh

        add_batch_shard_mesh(part, dims.mesh("dp"))  # a batch-scope balance loss counts the global batch
    from parallelisms.activation_checkpoint import apply_activation_checkpointing
    from parallelisms.compile import apply_compile

    apply_activation_checkpointing(part, cfg.activation_checkpoint, spec=spec, extra_save_ops=save_ops,
                                   compile_enabled=cfg.compile.enable)
    apply_compile(part, cfg.compile, cfg.activation_checkpoint, compute_dtype=precision.autocast or precision.param)
    dp_mesh = dims.fsdp_mesh()
    if dp_mesh is not None:
        from parallelisms.fsdp import apply_fsdp

        apply_fsdp(part, dp_mesh, param_dtype=precision.param, reduce_dtype=precision.reduce,
                   reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
                   pp_enabled=dims.pp_enabled, cpu_offload=cfg.parallelism.fsdp_cpu_offload,
                   backend=backend or ("nccl" if device_type == "cuda" else "gloo"))
    return part


@dataclass
class ModelParts:
    """This rank's share of the model: one part, or its pipeline stages and schedule."""

    parts: list[nn.Module]
    schedule: Any = None  # a torch.distributed.pipelining schedule under PP
    has_first_stage: bool = True
    has_last_stage: bool = True
    summary: dict[str, float] = field(default_factory=dict)
    # (name, meta param) of the whole model before the PP split: what a config rule over
    # parameter names (optimizer.muon_params) is checked against on every stage alike
    whole_model_params: list = field(default_factory=list)


def build_model_parts(spec, args, dims, cfg, device: torch.device, *, loss_fn: Callable | None = None,
                      prepare: Callable[[nn.Module], None] | None = None, materialize: bool = True) -> ModelParts:
    """The whole assembly for this rank: meta model -> [PP split] -> `parallelize` -> materialise on
    `device` -> layout-independent init from `cfg.training.seed`.

    `prepare(model)` runs on the whole meta model before the split (e.g. installing the chunked
    CE head); `loss_fn(output, labels)` is what a pipeline schedule calls on the last stage."""
    model = build_model(spec, args)
    summary = spec.summary_fn(model, args, cfg.training.seq_len) if spec.summary_fn else {}
    if prepare is not None:
        prepare(model)
    whole = list(model.named_parameters())
    if dims.pp_enabled:
        from parallelisms.pipeline import build_schedule, split_for_rank

        stages = split_for_rank(model, dims, cfg)
        parts = [parallelize(part, spec, dims, cfg) for _, part in stages]
        built = ModelParts(parts, summary=summary, whole_model_params=whole)
        built.schedule, built.has_first_stage, built.has_last_stage = build_schedule(
            parts, [sid for sid, _ in stages], dims, cfg, loss_fn, device)
    else:
        built = ModelParts([parallelize(model, spec, dims, cfg)], summary=summary, whole_model_params=whole)
    if materialize:
        from parallelisms.param_init import layout_independent_init

        for part in built.parts:
            part.to_empty(device=device)
        layout_independent_init(built.parts, cfg.training.seed, buffer_device=device)
        for part in built.parts:
            part.train()
    return built
