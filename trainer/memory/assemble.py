"""One rank's model, assembled by the trainer's own code on fake tensors, for the estimator to read.

Why: the estimator must not know the parallel plans. Whatever `parallelisms.apply`
does to a model part (TP -> EP -> AC -> FSDP, the PP split before it) is what the
estimate reads back: local parameter shapes from the DTensors (`to_local()`), FSDP's
units and all-gather sizes from its parameter groups, the blocks and the head as a
rank runs them. A new plan (a new model's TP plan, context parallelism) is therefore
estimated as soon as the trainer applies it.

How: `fake_world` opens a fake process group (`backend="fake"`: every collective is
a no-op that returns at once) of the configured world size, as a chosen global rank,
so `ParallelDims.build_mesh` builds the real device mesh. `assemble_rank` then runs
`build_model_parts` (meta model, PP split, `parallelize` on every part) and moves the
parts to fake CPU tensors (`to_empty` under one `FakeTensorMode`), so the probes can
run them without allocating anything. Differences to the trainer, both deliberate:
compile is off (the probes count eager execution), and for a GPU target the CPU
assembly is allowed bf16 (`mixed_precision_on_cpu`), so that FSDP's mixed precision
and autocast resolve as `resolve_precision` resolves them on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn


def default_world_size(par, gpus_per_node: int = 8, max_nodes: int = 4096) -> int:
    """The smallest multiple of `gpus_per_node` that the parallel degrees fit: explicit
    degrees must divide it, and EP must divide dp_shard x cp x tp (the ranks it borrows)."""
    fixed = par.data_parallel_replicate_degree * par.tensor_parallel_degree * par.pipeline_parallel_degree * \
        par.context_parallel_degree
    if par.data_parallel_shard_degree > 0:
        fixed *= par.data_parallel_shard_degree
    for nodes in range(1, max_nodes + 1):
        world = nodes * gpus_per_node
        if world % fixed:
            continue
        if par.data_parallel_shard_degree > 0 and world != fixed:
            continue
        dp_shard = par.data_parallel_shard_degree if par.data_parallel_shard_degree > 0 else world // fixed
        if (dp_shard * par.context_parallel_degree * par.tensor_parallel_degree) % par.expert_parallel_degree:
            continue
        return world
    return fixed  # explicit degrees whose product is not a multiple of gpus_per_node


@dataclass
class Layout:
    """The resolved degrees of one run (what `ParallelDims` resolves), for the report."""

    world: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    fsdp: bool  # FSDP/HSDP wrapping happens (mixed precision applies)
    sequence_parallel: bool
    loss_parallel: bool

    def token_seq(self, seq_len: int) -> int:
        """Tokens of one sample on this rank: its labels, RoPE rows, the embedding's output
        (context parallelism gives each rank seq_len / cp of them)."""
        return seq_len // self.cp

    def residual_seq(self, seq_len: int) -> int:
        """Rows of one sample's residual stream between blocks on this rank: sequence
        parallel shards it over TP (and context parallelism, through `token_seq`)."""
        tokens = self.token_seq(seq_len)
        return tokens // self.tp if self.sequence_parallel else tokens


def resolve_layout(cfg, world_size: int) -> Layout:
    from parallelisms.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    par = cfg.parallelism
    return Layout(world=world_size, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp,
                  pp=dims.pp, ep=dims.ep, fsdp=dims.dp_shard * dims.cp > 1 or dims.dp_replicate > 1,
                  sequence_parallel=par.enable_sequence_parallel and dims.tp > 1,
                  loss_parallel=dims.tp > 1 and not par.disable_loss_parallel)


def assembly_config(cfg, device: str):
    """A shallow copy of `cfg` for the CPU assembly of a run on `device` (see the module doc)."""
    out = copy.copy(cfg)
    out.compile = dataclasses.replace(cfg.compile, enable=False)
    if device != "cpu":
        out.training = copy.copy(cfg.training)
        out.training.mixed_precision_on_cpu = True
    return out


def chunked_ce_allowed(cfg) -> bool:
    """Whether the config's own validators accept `loss.chunked_ce = true` for this layout
    and model (asked of them, not restated: TP, PP, MTP...)."""
    from parallelisms.float8 import float8_filter
    from parallelisms.parallel_dims import check_layout
    from configuration.fields import ConfigError

    try:
        check_layout(cfg.parallelism, cfg.model_args, seq_len=cfg.training.seq_len,
                     local_batch_size=cfg.training.local_batch_size, model_spec=cfg.model_spec, chunked_ce=True,
                     float8_filter=float8_filter(cfg.float8))
        dataclasses.replace(cfg.loss, chunked_ce=True).validate(cfg)
    except ConfigError:
        return False
    return True


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """A fake default process group of `world_size` ranks, this process being `rank`."""
    import sys

    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers backend "fake"
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    if dist.is_initialized():
        raise RuntimeError("the memory estimator lays the model out under its own fake process group; "
                           "call it outside a distributed job")
    excepthook = sys.excepthook  # init_process_group wraps it to prefix tracebacks with the rank
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        # DTensor caches sharding decisions by mesh shape and names, with the mesh (and so
        # its process groups) inside: the next world's equal mesh must not find this one's.
        _clear_sharding_prop_cache()


@dataclass
class AssembledRank:
    """One rank's model parts as the trainer builds them, on fake CPU tensors."""

    parts: list[nn.Module]
    dims: object  # ParallelDims, mesh built
    precision: object  # parallelisms.apply.Precision
    fake_mode: object  # the FakeTensorMode the parts live in (probes must run under it)
    pp_rank: int
    stage_layer_ids: list[list[int]]  # the block ids of each part, in order

    @property
    def stream_dtype(self) -> torch.dtype:
        """The residual stream's dtype: FSDP's compute dtype (its gathered parameters, hence
        the embedding's output), else fp32 (autocast, if any, casts inside the ops)."""
        return self.precision.param if self.dims.fsdp_mesh() is not None else torch.float32


def _layer_ids(part: nn.Module) -> list[int]:
    return [int(k) for k in part.layers.keys()]


def _to_empty_keeping_ties(part: nn.Module) -> None:
    """`to_empty` gives each module its own tensor, so a parameter two modules share (a tied
    embedding and head) would be counted twice. The trainer re-ties in `init_weights`, which the
    estimator never runs: here every module that shared a parameter gets the first owner's again."""
    owners: dict[int, tuple[nn.Module, str]] = {}
    aliases: list[tuple[nn.Module, str, nn.Module, str]] = []
    for mod in part.modules():
        for name, p in mod.named_parameters(recurse=False):
            if id(p) in owners:
                aliases.append((mod, name, *owners[id(p)]))
            else:
                owners[id(p)] = (mod, name)
    part.to_empty(device="cpu")
    for mod, name, owner, owner_name in aliases:
        setattr(mod, name, getattr(owner, owner_name))


@contextlib.contextmanager
def assemble_rank(cfg, world_size: int, *, pp_rank: int = 0, device: str = "cuda", fake: bool = True):
    """Yields the `AssembledRank` of PP rank `pp_rank` (data/TP/EP coordinate 0) of `cfg`
    on `world_size` ranks, assembled by `parallelisms.apply.build_model_parts`. `fake=False`
    leaves the parts on the meta device: enough to read parameter shapes and FSDP units, not
    to probe (moving every parameter to a fake tensor is half an assembly's time)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from parallelisms.apply import build_model_parts, resolve_precision
    from parallelisms.parallel_dims import ParallelDims
    from trainer.loss import install_chunked_ce_head

    acfg = assembly_config(cfg, device)
    dims = ParallelDims.from_config(acfg.parallelism, world_size)
    # PP is the outermost mesh dimension: PP rank r starts at global rank r * world / pp.
    with fake_world(world_size, pp_rank * (world_size // dims.pp)):
        dims.build_mesh("cpu")
        precision = resolve_precision(acfg.training, "cpu", dims.fsdp_mesh() is not None)
        # The chunked-CE head wherever the trainer allows it: called without labels it is the
        # plain Linear (same parameter, same FSDP unit), so both loss paths can be probed.
        loss_cfg = dataclasses.replace(acfg.loss, chunked_ce=chunked_ce_allowed(acfg)) \
            if not acfg.loss.chunked_ce else acfg.loss
        built = build_model_parts(acfg.model_spec, acfg.model_args, dims, acfg, torch.device("cpu"),
                                  prepare=lambda model: install_chunked_ce_head(model, loss_cfg),
                                  materialize=False)
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode:
            for part in built.parts if fake else ():
                _to_empty_keeping_ties(part)
        yield AssembledRank(parts=built.parts, dims=dims, precision=precision, fake_mode=fake_mode,
                            pp_rank=pp_rank, stage_layer_ids=[_layer_ids(p) for p in built.parts])
