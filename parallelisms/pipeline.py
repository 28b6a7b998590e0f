"""Pipeline parallelism with torch.distributed.pipelining.

`split_for_rank` splits the meta-device model into `pp_degree x stages_per_rank`
stages and keeps this rank's; `parallelisms.apply` parallelizes each one, then
`build_schedule` wraps them in a schedule.

Splitting: each stage is a deep copy of the whole (meta) model with what it does not
own removed: `tok_embeddings` / `norm` / `output` set to None, blocks deleted from the
`layers` ModuleDict. Names therefore stay those of the full model
(`layers.7.attention.wq.weight`), so checkpoints load under any layout. By default
stages get contiguous runs of blocks, balanced by a cost in which the embedding and
the output head (with the final norm) each count as one block;
`parallelism.module_fqns_per_model_part` overrides the split by module names.

Stage placement: loop style (stage s on PP rank s % pp) for single-stage and
interleaved schedules; V style for ZBVZeroBubble and DualPipeV (rank r holds stages r
and 2*pp-1-r, so rank 0 holds the first and the last stage).

Loss scaling: the trainer's loss is a sum over tokens divided by the global number of
valid tokens of the step, exactly as without PP, so the schedule must not rescale
gradients: every schedule is built with `scale_grads=False` (its default, True,
divides gradients by the number of microbatches after the last backward).
"""

from __future__ import annotations

import copy
import logging
from typing import Callable

import torch
import torch.nn as nn

from parallelisms.parallel_dims import V_SCHEDULES, check_pipeline_layout
from configuration.environment import global_rank

logger = logging.getLogger("pipeline")


# ---- splitting ----
def model_units(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """(modules before the blocks, block names "layers.K", modules after the blocks), by
    top-level child order; absent (None) children are skipped."""
    pre, layers, post = [], [], []
    seen_layers = False
    for name, child in model.named_children():
        if name == "layers":
            seen_layers = True
            layers = [f"layers.{k}" for k in child.keys()]
        elif child is not None:
            (post if seen_layers else pre).append(name)
    return pre, layers, post


def split_stages(model: nn.Module, num_stages: int, pre_weight: float = 1.0, post_weight: float = 1.0,
                 ) -> list[list[str]]:
    """Contiguous module names per stage, balanced by cost: each block costs 1, the
    modules before the blocks (embedding) `pre_weight`, those after (norm + head)
    `post_weight`. Every stage gets at least one block (needs num_stages <= blocks)."""
    pre, layers, post = model_units(model)
    counts = stage_block_counts(len(layers), num_stages, pre_weight, post_weight)
    out, start = [], 0
    for s, c in enumerate(counts):
        names = list(layers[start:start + c])
        start += c
        if s == 0:
            names = pre + names
        if s == num_stages - 1:
            names = names + post
        out.append(names)
    return out


def stage_block_counts(n: int, num_stages: int, pre_weight: float = 1.0, post_weight: float = 1.0) -> list[int]:
    """Blocks per stage of `split_stages` for `n` blocks (also the planner's, for the busiest rank)."""
    if num_stages > n:
        raise ValueError(f"{num_stages} stages need at least {num_stages} blocks, the model has {n}")
    total = n + pre_weight + post_weight
    per = total / num_stages
    if per < 2:
        # Too few blocks to give the ends a lighter share: spread the blocks evenly,
        # the remainder going to the middle stages.
        counts = [n // num_stages] * num_stages
        rem = n - sum(counts)
        order = sorted(range(num_stages), key=lambda s: abs(s - (num_stages - 1) / 2))
        for s in order[:rem]:
            counts[s] += 1
    else:
        # Cut the cost line [0, total) at multiples of `per`; a block sits at
        # [pre_weight + i, pre_weight + i + 1) and goes to the stage holding its middle.
        counts = [0] * num_stages
        for i in range(n):
            mid = pre_weight + i + 0.5
            counts[min(num_stages - 1, int(mid // per))] += 1
        # Guarantee a block per stage (rounding can starve a stage next to a heavy end).
        for s in range(num_stages):
            if counts[s] == 0:
                donor = max(range(num_stages), key=lambda d: counts[d])
                counts[donor] -= 1
                counts[s] += 1
    return counts


def check_split(model: nn.Module, fqns_per_stage: list[list[str]]) -> None:
    """Every module of the model in exactly one stage, in model order, no unknown names."""
    from configuration.fields import ConfigError

    pre, layers, post = model_units(model)
    known = pre + layers + post
    flat = [name for stage in fqns_per_stage for name in stage]
    unknown = [n for n in flat if n not in known]
    if unknown:
        raise ConfigError(f"config error: parallelism.module_fqns_per_model_part: unknown module(s) {unknown}; "
                          f"valid names: {pre + ['layers.0', '...', f'layers.{len(layers) - 1}'] + post}")
    missing = [n for n in known if n not in flat]
    dup = sorted({n for n in flat if flat.count(n) > 1})
    if missing or dup:
        raise ConfigError(f"config error: parallelism.module_fqns_per_model_part: every module must be in exactly "
                          f"one stage (missing {missing}, repeated {dup}); list each once")
    if any(not stage for stage in fqns_per_stage):
        raise ConfigError("config error: parallelism.module_fqns_per_model_part: a stage is empty; give every "
                          "stage at least one module")
    if [known.index(n) for n in flat] != sorted(known.index(n) for n in flat):
        raise ConfigError("config error: parallelism.module_fqns_per_model_part: stages must hold the modules in "
                          "model order (embedding, layers.0, layers.1, ..., norm, output)")


def prune_to_stage(model: nn.Module, keep: list[str]) -> nn.Module:
    """Deletes (in place) what a stage does not own; kept names are unchanged."""
    keep_set = set(keep)
    for name, child in list(model.named_children()):
        if name == "layers":
            for key in list(child.keys()):
                if f"layers.{key}" not in keep_set:
                    del child[key]
        elif child is not None and name not in keep_set:
            setattr(model, name, None)
    return model


def stage_ids_for_rank(pp_rank: int, pp: int, stages_per_rank: int, v_style: bool) -> list[int]:
    if v_style:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


# ---- building ----
def _stage_class():
    from torch.distributed.pipelining import PipelineStage

    class BufferSafeStage(PipelineStage):
        """A PipelineStage whose shape-inference pass leaves the model's buffers alone.

        On the first step the stage infers its input/output shapes by running one forward
        and backward, on empty tensors for all but the first stage. Stateful buffers (MoE
        expert-load counters feeding the load-balance bias update) would count that pass,
        so they are snapshotted before it and restored after it."""

        _saved_buffers: list | None = None

        def _forward_metadata_inference(self, *args, **kwargs):
            if self._saved_buffers is None:
                self._saved_buffers = [(b, b.detach().clone()) for b in self.submod.buffers()]
            return super()._forward_metadata_inference(*args, **kwargs)

        def _post_metadata_inference_cleanup(self) -> None:
            super()._post_metadata_inference_cleanup()
            if self._saved_buffers is not None:
                with torch.no_grad():
                    for buf, saved in self._saved_buffers:
                        buf.copy_(saved)
                self._saved_buffers = None

    return BufferSafeStage


def split_for_rank(model: nn.Module, dims, cfg) -> list[tuple[int, nn.Module]]:
    """(stage id, stage) for this PP rank's stages: deep copies of the meta `model`, pruned."""
    pcfg = cfg.parallelism
    name, spr, pp = pcfg.pipeline_parallel_schedule, pcfg.pipeline_parallel_stages_per_rank, dims.pp
    check_pipeline_layout(pcfg, len(model.layers), cfg.training.local_batch_size)
    num_stages = pp * spr
    if pcfg.module_fqns_per_model_part is not None:
        fqns = [list(stage) for stage in pcfg.module_fqns_per_model_part]
    else:
        fqns = split_stages(model, num_stages)
    check_split(model, fqns)
    v_style = name in V_SCHEDULES
    stage_ids = stage_ids_for_rank(dims.mesh("pp").get_local_rank(), pp, spr, v_style)
    if global_rank() == 0:
        logger.info(f"pipeline: {name}, {num_stages} stages ({spr} per rank, {'V' if v_style else 'loop'} placement), "
                    f"{cfg.training.local_batch_size // pcfg.pipeline_parallel_microbatch_size} microbatches; "
                    + "; ".join(f"stage {s}: {_describe(f)}" for s, f in enumerate(fqns)))
    return [(sid, prune_to_stage(copy_for_stage(model, fqns[sid]), fqns[sid])) for sid in stage_ids]


def copy_for_stage(model: nn.Module, keep: list[str]) -> nn.Module:
    """A deep copy of `model` in which the modules the stage drops are None (`prune_to_stage`
    then removes them): copying every block for every stage was most of a large model's
    PP assembly time (1 s of 1.5 s per rank of a 61-block meta model)."""
    keep_set = set(keep)
    memo: dict = {}
    for name, child in model.named_children():
        if name == "layers":
            memo.update({id(block): None for key, block in child.items() if f"layers.{key}" not in keep_set})
        elif child is not None and name not in keep_set:
            memo[id(child)] = None
    return copy.deepcopy(model, memo)


def build_schedule(parts: list[nn.Module], stage_ids: list[int], dims, cfg, loss_fn: Callable,
                   device: torch.device):
    """(schedule, has_first_stage, has_last_stage) over this rank's parallelized stages."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    from configuration.fields import ConfigError

    pcfg = cfg.parallelism
    name = pcfg.pipeline_parallel_schedule
    num_stages = dims.pp * pcfg.pipeline_parallel_stages_per_rank
    stage_cls = _stage_class()
    pp_group = dims.mesh("pp").get_group()
    stages = [stage_cls(part, sid, num_stages, device, group=pp_group) for sid, part in zip(stage_ids, parts)]
    n_microbatches = cfg.training.local_batch_size // pcfg.pipeline_parallel_microbatch_size
    cls = get_schedule_class(name)
    try:
        if issubclass(cls, PipelineScheduleSingle):
            schedule = cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        else:
            schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    except ValueError as e:  # the schedule's own layout checks, as a one-line config error
        raise ConfigError(f"config error: parallelism.pipeline_parallel_schedule: {name}: "
                          f"{' '.join(str(e).split())}") from None
    return schedule, any(s.is_first for s in stages), any(s.is_last for s in stages)


def _describe(names: list[str]) -> str:
    out, run = [], []

    def flush():
        if run:
            out.append(f"layers {run[0]}-{run[-1]}" if len(run) > 1 else f"layer {run[0]}")
            run.clear()

    for n in names:
        if n.startswith("layers."):
            run.append(n.split(".", 1)[1])
        else:
            flush()
            out.append(n)
    flush()
    return " + ".join(out)
