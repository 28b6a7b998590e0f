"""The estimate: per-rank memory of one training step, from the assembled model and the probes.

What is summed, and why in this shape (docs/memory.md has the full table):

- persistent: fp32 parameters and the optimizer's states (AdamW's two moments, Muon's
  momentum: trainer/memory/optimizer_terms.py) (gradients are not persistent: they
  count in the backward phases, where they are allocated), each at this rank's local size as the assembly holds it (`to_local()` of every parameter after TP, EP
  and FSDP); under PP the pipeline rank with the most;
- FSDP buffers: the gathered units (FSDP's own all-gather sizes, padding included,
  in its compute dtype): the unit running and the one prefetched plus the norm+output
  unit that is not resharded, or every unit of the rank under PP;
- activations: what each probed block keeps for backward, over this rank's blocks,
  times the microbatches its pipeline schedule keeps in flight, plus the embedding's;
- the step's peak: the largest of four phases (forward+loss, loss backward, the last
  block's backward, the optimizer step) on top of the persistent state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from trainer.memory.assemble import Layout, default_world_size, resolve_layout
from trainer.memory.device_overhead import GpuOverheads, gpu_overhead_terms
from trainer.memory.optimizer_terms import optimizer_terms
from trainer.memory.probes import BlockProbe
from trainer.memory.rank_facts import (  # noqa: F401 - re-exported: the readers lived here
    BlockReadout,
    RankParams,
    probe_blocks,
    probe_heads,
    read_every_rank,
    read_params,
)

GiB = 1024**3
MiB = 1024**2


@dataclass
class MemoryEstimate:
    config: str
    model: str
    world_size: int
    layout: Layout
    device: str
    compute_dtype: str
    ac_mode: str
    chunked_ce: bool
    tokens_per_microbatch: int
    blocks_on_rank: int
    in_flight_microbatches: float
    # persistent, per rank (bytes)
    params: int
    grads: int
    optimizer: int
    # per step
    fsdp_buffers: int
    activations_per_block: dict  # "mode/kind" -> bytes of one block
    activations: int  # all blocks on this rank, all in-flight microbatches (+ embedding)
    loss_saved: int  # final norm + head + loss, kept for backward
    loss_peak: int  # peak of the logits/loss region (forward or backward), incl. what it keeps
    loss_peak_other: int | None  # the same for the other CE path (None: that path is refused here)
    block_backward: int  # transient of one block's backward (recompute + grad buffers)
    optimizer_step: int  # optimizer temporaries (foreach AdamW: one fp32 copy of the params; Muon's NS)
    optimizer_states: str = "AdamW: 2 x fp32"  # what `optimizer` holds, for the report
    phases: dict = field(default_factory=dict)  # step phase -> bytes above the persistent state
    notes: list = field(default_factory=list)
    # CUDA only: what the GPU spends beyond tensors (trainer/memory/device_overhead.py)
    device_terms: dict = field(default_factory=dict)
    # gradients held through the forward and backward phases (accumulation; PP with FSDP:
    # unsharded, `_pp_fsdp_held_grads`); 0 when they exist only from the backward on
    held_grads: int = 0
    # the local gradients of modules done with backward inside a backward phase (they shrink
    # with the sharding, planner/memory.py; not `held_grads`); the earlier blocks' are in `earlier_blocks`
    phase_grads: dict = field(default_factory=dict)
    # (bytes, of which gradients) of each block's backward before the last's: the
    # "earlier block backward" phase is their largest (`_earlier_block_backward`)
    earlier_blocks: list = field(default_factory=list)

    @property
    def persistent(self) -> int:
        return self.params + self.optimizer

    @property
    def step_peak(self) -> int:
        return max(self.phases.values())

    @property
    def total(self) -> int:
        """Estimated peak per rank: persistent state + the largest step phase."""
        return self.persistent + self.step_peak

    @property
    def device_total(self) -> int:
        """`total` plus the device terms (CUDA context, NCCL, fragmentation, EP imbalance):
        what must fit in the GPU's memory. Equals `total` off CUDA."""
        return self.total + sum(self.device_terms.values())

    @property
    def saved_activations(self) -> int:
        """Everything kept for backward in one microbatch's forward (blocks + head/loss)."""
        return self.activations + self.loss_saved

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(persistent=self.persistent, step_peak=self.step_peak, total=self.total,
                 saved_activations=self.saved_activations, device_total=self.device_total)
        return d


# ---------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------

def _in_flight_units(schedule: str, pp: int, spr: int, n_mb: int, pp_rank: int = 0) -> int:
    """Stage-microbatches whose activations a PP rank holds at once (each = that stage's
    blocks x one microbatch): GPipe all; 1F1B warm-up depth; interleaved/V schedules
    the interleaved warm-up ((v-1) x pp + 2 x (pp-1-rank)) + 1."""
    if pp == 1:
        return 1
    if schedule in ("GPipe", "LoopedBFS"):
        return n_mb * spr
    if schedule == "1F1B":
        return min(n_mb, pp - pp_rank)
    warmup = (spr - 1) * pp + 2 * (pp - 1 - pp_rank)
    return min(n_mb * spr, warmup + 1)


def _optimizer_impl(cfg, device: str) -> str:
    impl = cfg.optimizer.implementation
    if impl == "auto":
        impl = "fused" if device == "cuda" else "foreach"
    return impl


def _fsdp_buffers(layout: Layout, par, heavy: RankParams, esize: int, dtype: torch.dtype) -> int:
    if not layout.fsdp:
        return 0
    units = heavy.unit_bytes
    largest_block = max((b for u, b in units.items() if u.startswith("layers.")), default=0)
    # Under PP every unit stays gathered whatever the setting: torch's pipeline stage turns FSDP's
    # reshard after backward off until the last microbatch (`backward_maybe_with_nosync`).
    reshard = layout.pp == 1 and par.fsdp_reshard_after_forward != "never"
    if reshard:
        # the unit running + the next one prefetched, and the norm+output unit kept gathered
        head = units.get("head", 0) if par.fsdp_reshard_after_forward != "always" else 0
        buffers = 2 * largest_block + head
    else:
        buffers = sum(units.values())
    if dtype != torch.float32:
        buffers += largest_block * 4 // esize  # the block's reduce-scatter input in fp32
    return int(buffers * esize)


EARLIER_BLOCK_BACKWARD = "earlier block backward"


def _earlier_block_backward(layout: Layout, par, rank0: RankParams, blocks, ids: list[int], activations: int,
                            head_grads: int, esize: int, reduce_dtype: torch.dtype,
                            offload: bool) -> list[tuple[int, int]]:
    """(bytes, of which local gradients) of each block's backward but the last's (one stage, no
    accumulated grads). Block k's backward runs with the activations of blocks up to
    k and the local gradients of everything whose backward came before: the later blocks,
    DeepSeek's MTP modules and the head (`head_grads`). Where activations are small next to
    the parameters that makes the first block's backward the step's peak. The gradients are
    returned apart, block by block, because a planner scales them with the sharding
    (planner/memory.py), and which block is the worst depends on it.

    FSDP2 at block k: k's unit and the one it prefetches (block k-1's; the embedding's for
    the first block) are gathered, or, without reshard after forward, every unit up to k
    (backward still reshards each after its own); the norm+output unit has been resharded;
    and block k+1's reduce-scatter input is held until k's starts
    (`reduce_scatter_max_input_buffers` 1), in the reduce dtype."""
    units = rank0.unit_bytes
    unit = [units.get(f"layers.{lid}", 0) for lid in ids]
    embedding = units.get("tok_embeddings", 0)
    rsize = torch.tensor([], dtype=reduce_dtype).element_size()
    grads_of = [rank0.layer_param_bytes.get(lid, 0) for lid in ids]
    later_grads = sum(grads_of) + rank0.early_param_bytes + head_grads
    if offload:  # the sharded gradients live on the host
        grads_of, later_grads = [0] * len(ids), 0
    later_saved = sum(blocks.probes[blocks.kind_of[lid]].saved for lid in ids)
    out = []
    for k, lid in enumerate(ids[:-1]):  # forward order; block k's backward runs after every later block's
        probe = blocks.probes[blocks.kind_of[lid]]
        later_grads -= grads_of[k]
        later_saved -= probe.saved  # freed by the later blocks' backward
        buffers = 0
        if layout.fsdp:
            prefetched = unit[k - 1] if k else embedding
            gathered = unit[k] + prefetched if par.fsdp_reshard_after_forward != "never" else sum(unit[:k + 1]) + embedding
            buffers = gathered * esize + unit[k + 1] * rsize
        live = buffers + activations - later_saved + later_grads + probe.input_bytes + probe.backward_extra
        out.append((live, later_grads))
    return out


def _pp_fsdp_held_grads(heavy: RankParams, reduce_dtype: torch.dtype, grad_accum: int) -> int:
    """Gradients a PP rank under FSDP holds through its step. torch's pipeline stage turns
    FSDP's gradient sync off for every microbatch's backward (`backward_maybe_with_nosync`:
    `set_requires_gradient_sync(False)`) and reduces once after the last (`perform_reduce_grad`),
    so every unit keeps its *unsharded* gradient across the step's microbatches, in the reduce
    dtype (FSDP2 upcasts it to accumulate in); parameters outside FSDP (experts EP takes whole)
    keep their own; and with gradient accumulation the sharded gradients of the earlier
    accumulation steps stay too. About 24 GiB per rank on llama405b.toml (8 layers' fp32
    gradients at TP 8), where the sharded ones are 3."""
    unsharded = sum(heavy.unit_bytes.values()) * torch.tensor([], dtype=reduce_dtype).element_size()
    outside = heavy.param_bytes - heavy.fsdp_param_bytes
    return unsharded + outside + (heavy.fsdp_param_bytes if grad_accum > 1 else 0)


def _skew(layout: Layout, device: str, ov: GpuOverheads) -> float | None:
    """The EP receive factor of the busiest rank, where the estimate adds it (CUDA, EP)."""
    return ov.ep_imbalance if device == "cuda" and layout.ep > 1 and ov.ep_imbalance > 1 else None


def _microbatch(cfg, layout: Layout) -> int:
    par = cfg.parallelism
    return par.pipeline_parallel_microbatch_size if layout.pp > 1 else cfg.training.local_batch_size


def estimate_memories(cfgs: list, world_size: int, *, device: str = "cuda", overheads=None,
                      cache) -> list[MemoryEstimate]:
    """`estimate_memory` of configs that differ only in their batch sizes, through one
    `EstimateCache`: their assemblies are shared (one rank-0 assembly probes every batch).
    `overheads`: one `GpuOverheads` (or None) for all, or a list with one per config."""
    each = overheads if isinstance(overheads, list) else [overheads] * len(cfgs)
    items = []
    for cfg, ov in zip(cfgs, each):
        if cfg.model_args is None:
            cfg.validate()
        layout = resolve_layout(cfg, world_size)
        items.append((cfg, layout, _microbatch(cfg, layout), _skew(layout, device, ov or GpuOverheads())))
    cache.read(items, world_size, device)
    return [estimate_memory(cfg, world_size, device=device, overheads=ov, cache=cache) for cfg, ov in zip(cfgs, each)]


def estimate_memory(cfg, world_size: int | None = None, *, device: str = "cuda", gpus_per_node: int = 8,
                    config_name: str = "", overheads: GpuOverheads | None = None, cache=None) -> MemoryEstimate:
    """Per-rank memory of a training step of `cfg` (a JobConfig) on `world_size` ranks.
    On CUDA, `overheads` (default `GpuOverheads()`) gives the device terms beyond tensors.
    `cache`: a `trainer.memory.estimate_cache.EstimateCache` shared between estimates (the
    same bytes, fewer assemblies); None: every PP rank is assembled afresh."""
    from configuration.fields import ConfigError
    from trainer.model_args import model_label

    if cfg.model_args is None:  # a JobConfig built in code, not by load_config
        cfg.validate()
    world = world_size or default_world_size(cfg.parallelism, gpus_per_node)
    layout = resolve_layout(cfg, world)
    t, par, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    if ac.mode == "memory_budget":
        raise ConfigError("config error: activation_checkpoint.mode: memory_budget is chosen by the compile "
                          "partitioner and has no eager count; estimate with none/full/op instead")
    notes: list[str] = []
    if layout.pp > 1:
        mb = par.pipeline_parallel_microbatch_size
        n_mb = t.local_batch_size // mb
    else:
        mb, n_mb = t.local_batch_size, 1
    grad_accum = 1
    if t.global_batch_size > 0:
        grad_accum = max(1, t.global_batch_size // (t.local_batch_size * layout.dp_replicate * layout.dp_shard))

    ov = overheads or GpuOverheads()
    skew_factor = _skew(layout, device, ov)
    if cache is not None:
        facts = cache.read([(cfg, layout, mb, skew_factor)], world, device)[0]
    else:  # every PP rank as the trainer assembles it; probes on rank 0
        facts = read_every_rank(cfg, world, layout, mb, device, skew_factor)
    per_rank, communicators, blocks, heads, skewed = (facts.per_rank, facts.communicators, facts.blocks,
                                                      facts.heads, facts.skewed)
    precision, stage_layers, dtype = facts.precision, facts.stage_layers, facts.dtype
    heavy = max(per_rank, key=lambda r: r.param_bytes)
    p_bytes = heavy.param_bytes
    opt = optimizer_terms(cfg, heavy.matrices, p_bytes, device, _optimizer_impl(cfg, device))
    grads, optimizer = p_bytes, opt.states
    offload = layout.fsdp and par.fsdp_cpu_offload
    if offload:
        notes.append("fsdp_cpu_offload: sharded params, grads and optimizer states live in host memory (not counted)")
    autocast = precision.autocast
    esize = torch.tensor([], dtype=dtype).element_size()

    # ---- activations: rank 0's blocks with its schedule's in-flight microbatches (PP) ----
    def block_saved(lid: int) -> int:
        return blocks.probes[blocks.kind_of[lid]].saved

    per_block: dict[str, int] = {}
    for kind, label in blocks.label_of.items():
        per_block.setdefault(label, blocks.probes[kind].saved)
    stage_bytes = [sum(block_saved(i) for i in ids) for ids in stage_layers]
    if layout.pp > 1:
        in_flight_units = _in_flight_units(par.pipeline_parallel_schedule, layout.pp,
                                           par.pipeline_parallel_stages_per_rank, n_mb)
        activations = max(stage_bytes) * in_flight_units
        in_flight = in_flight_units / len(stage_layers)
    else:
        activations, in_flight = sum(stage_bytes), 1.0
    activations += blocks.embedding_saved
    if device == "cpu" and layout.cp > 1:  # CP attention's additive masks on CPU, shared by every layer
        from parallelisms.context_parallel import cpu_mask_bytes

        activations += cpu_mask_bytes(t.seq_len, layout.cp, par.context_parallel_method, esize)
    layers_rank0 = [lid for ids in stage_layers for lid in ids]

    # ---- logits / loss ----
    head, other = heads
    loss_peak = max(head.forward_peak, head.backward_peak)
    loss_peak_other = max(other.forward_peak, other.backward_peak) if other is not None else None

    fsdp_buffers = _fsdp_buffers(layout, par, heavy, esize, dtype)
    if layout.fsdp:
        notes.append("FSDP buffers: gathered params of the running + prefetched unit and the kept norm+output "
                     "unit, in the compute dtype")

    # ---- phases (bytes above params + optimizer states) ----
    # grads alive before backward: none (zero_grad sets them to None), unless they
    # accumulate over microbatches (grad accumulation, PP).
    accum_grads = grads if (grad_accum > 1 or layout.pp > 1) else 0
    if layout.pp > 1 and layout.fsdp and not offload:
        accum_grads = _pp_fsdp_held_grads(heavy, precision.reduce, grad_accum)
    phases = {}
    # Autocast (no FSDP) caches the low-precision copy of every weight it casts until the
    # forward+loss region ends; blocks without AC save those copies anyway (counted above).
    autocast_cache = 0
    if autocast is not None:
        csize = torch.tensor([], dtype=autocast).element_size()
        autocast_cache = sum(numel * csize for lid, numel in per_rank[0].matrix_numel.items()
                             if lid in layers_rank0 and blocks.kind_of[lid][1] != "none")
    phases["forward+loss"] = fsdp_buffers + accum_grads + activations + head.forward_peak + autocast_cache
    phases["loss backward"] = fsdp_buffers + accum_grads + activations + head.backward_peak
    # Backward through the blocks, last first: blocks before i still hold activations,
    # blocks after i hold their (local, fp32) grads; block i runs its backward transient.
    worst_block = 0
    phase_grads: dict[str, int] = {}
    earlier: list[tuple[int, int]] = []
    if stage_layers and stage_layers[-1]:
        pr_last: BlockProbe = blocks.probes[blocks.kind_of[stage_layers[-1][-1]]]
        head_grad_live = heavy.head_param_bytes if layout.fsdp else head.weight_grad_bytes
        if layout.pp > 1 and layout.fsdp:
            head_grad_live = 0  # held unsharded with every unit's (`_pp_fsdp_held_grads`)
        worst_block = pr_last.backward_extra
        phases["block backward"] = (fsdp_buffers + accum_grads + activations + head_grad_live +
                                    pr_last.input_bytes + worst_block)
        phase_grads["block backward"] = head_grad_live
        if layout.pp == 1 and not accum_grads and len(stage_layers[0]) > 1:
            earlier = _earlier_block_backward(layout, par, per_rank[0], blocks, stage_layers[0], activations,
                                              head_grad_live, esize, precision.reduce, offload)
            phases[EARLIER_BLOCK_BACKWARD] = max(live for live, _ in earlier)
    opt_tmp = opt.step
    phases["optimizer step"] = grads + opt_tmp
    if not layout.fsdp and layout.world > 1 and par.data_parallel_shard_degree == -1:
        notes.append(f"data_parallel_shard_degree -1 resolves to 1 on {world} ranks: no FSDP sharding (params, "
                     "grads and optimizer states are whole on every rank of the TP/PP group); pass --ngpu (e.g. "
                     "several nodes) to lay the config out with FSDP")
    if offload:  # Muon's assembly and NS still run on the device
        phases["optimizer step"] = opt_tmp = opt.device_step
        p_bytes, grads, optimizer = 0, 0, 0
    if cfg.compile.enable:
        notes.append("compile.enable: counted as eager execution (the compiled blocks may keep less)")
    if getattr(cfg.model, "mtp_depth", 0):
        notes.append(f"model.mtp_depth {cfg.model.mtp_depth}: the MTP modules' parameters are counted, their "
                     "activations and extra logits are not")

    device_terms: dict[str, int] = {}
    if device == "cuda":
        ep_extra = 0
        if skewed is not None:  # the busiest EP rank: its MoE blocks keep more, its backward needs more
            skew = {lid: skewed.probes[skewed.kind_of[lid]] for lid in layers_rank0}
            base = {lid: blocks.probes[blocks.kind_of[lid]] for lid in layers_rank0}
            ep_extra = sum(max(0, skew[lid].saved - base[lid].saved) for lid in layers_rank0)
            ep_extra += max((max(0, skew[lid].backward_extra - base[lid].backward_extra) for lid in layers_rank0),
                            default=0)
        tensor_peak = (p_bytes + optimizer) + max(phases.values())
        device_terms = gpu_overhead_terms(tensor_peak, communicators=communicators, ep_extra=ep_extra, overheads=ov)
    compute = str(autocast or dtype).replace("torch.", "") + (" (autocast)" if autocast else "")
    return MemoryEstimate(
        config=config_name, model=model_label(cfg), world_size=world, layout=layout,
        device=device, compute_dtype=compute, ac_mode=ac.mode, chunked_ce=cfg.loss.chunked_ce,
        tokens_per_microbatch=mb * layout.token_seq(t.seq_len), blocks_on_rank=len(layers_rank0), in_flight_microbatches=in_flight,
        params=int(p_bytes), grads=int(grads), optimizer=int(optimizer), fsdp_buffers=int(fsdp_buffers),
        activations_per_block=per_block, activations=int(activations), loss_saved=int(head.saved),
        loss_peak=int(loss_peak), loss_peak_other=None if loss_peak_other is None else int(loss_peak_other),
        block_backward=int(worst_block), optimizer_step=int(opt_tmp), phases={k: int(v) for k, v in phases.items()},
        optimizer_states="Muon: 1, AdamW: 2 x fp32" if cfg.optimizer.name == "muon" else "AdamW: 2 x fp32",
        notes=notes, device_terms=device_terms, held_grads=int(accum_grads),
        phase_grads={k: int(v) for k, v in phase_grads.items()}, earlier_blocks=earlier)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"


def format_estimate(est: MemoryEstimate) -> str:
    L = est.layout
    other = "off" if est.chunked_ce else "on"
    lines = [
        f"memory estimate: {est.model}{' (' + est.config + ')' if est.config else ''}, per rank, {est.device}",
        f"  world {est.world_size}: dp_replicate {L.dp_replicate} x dp_shard {L.dp_shard} x cp {L.cp} x tp {L.tp} "
        f"x pp {L.pp}"
        f" (ep {L.ep}); compute dtype {est.compute_dtype}{' (FSDP mixed precision)' if L.fsdp else ''}",
        f"  tokens per microbatch {est.tokens_per_microbatch}; AC {est.ac_mode}; chunked CE "
        f"{'on' if est.chunked_ce else 'off'}; blocks on the busiest rank {est.blocks_on_rank}"
        + (f"; in-flight microbatches {est.in_flight_microbatches:g}" if L.pp > 1 else ""),
        "",
        f"  {'parameters (fp32, sharded)':<44}{fmt_bytes(est.params):>12}",
        f"  {'gradients (fp32, sharded)':<44}{fmt_bytes(est.grads):>12}",
        f"  {'optimizer states (' + est.optimizer_states + ')':<44}{fmt_bytes(est.optimizer):>12}",
        f"  {'FSDP gathered params / reduce buffers':<44}{fmt_bytes(est.fsdp_buffers):>12}",
    ]
    if L.pp > 1 and L.fsdp:  # torch's pipeline stage turns FSDP's gradient sync off until the last microbatch
        lines.append(f"  {'gradients held over the microbatches':<44}{fmt_bytes(est.held_grads):>12}  (PP x FSDP: "
                     "unsharded)")
    for k, v in est.activations_per_block.items():
        lines.append(f"  {'activations per block (' + k + ')':<44}{fmt_bytes(v):>12}")
    lines += [
        f"  {'activations, all blocks on this rank':<44}{fmt_bytes(est.activations):>12}",
        f"  {'logits/loss: kept for backward':<44}{fmt_bytes(est.loss_saved):>12}",
        f"  {'logits/loss: peak (' + ('chunked' if est.chunked_ce else 'plain') + ' CE)':<44}"
        f"{fmt_bytes(est.loss_peak):>12}",
        f"  {'logits/loss: peak with chunked CE ' + other:<44}{fmt_bytes(est.loss_peak_other):>12}"
        + ("  (refused by the config: TP, PP or MTP)" if est.loss_peak_other is None else ""),
        f"  {'one block backward (recompute + grads)':<44}{fmt_bytes(est.block_backward):>12}",
        f"  {'optimizer step temporaries':<44}{fmt_bytes(est.optimizer_step):>12}",
        "",
        "  step phases (on top of params + optimizer states):",
    ]
    for k, v in est.phases.items():
        mark = "  <- peak" if v == est.step_peak else ""
        lines.append(f"    {k:<42}{fmt_bytes(v):>12}{mark}")
    lines += ["", f"  {'TOTAL (estimated peak per rank)':<44}{fmt_bytes(est.total):>12}"]
    if est.device_terms:
        lines.append("  beyond tensors, on the GPU (trainer/memory/device_overhead.py):")
        lines += [f"    {k:<42}{fmt_bytes(v):>12}" for k, v in est.device_terms.items()]
        lines.append(f"  {'TOTAL on the GPU (tensors + the above)':<44}{fmt_bytes(est.device_total):>12}")
    lines += [f"  note: {n}" for n in est.notes]
    return "\n".join(lines)
