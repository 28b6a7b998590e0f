"""Per-rank training memory, estimated on the meta device / FakeTensorMode (nothing is allocated).

`estimate_memory(cfg, world_size=...)` returns a `MemoryEstimate` for one config:

- parameters, gradients (fp32) and AdamW states (2 x fp32), after FSDP / HSDP / TP /
  PP / EP sharding, counted parameter by parameter on the meta model (FSDP2 shards
  dim 0 with padding, so a shard is ceil(dim0 / shards) rows);
- FSDP buffers: unsharded params in the compute dtype (the units being run and
  prefetched, the norm+output unit that is not resharded, and every unit under PP);
- activations: the bytes one block keeps for backward under the configured AC mode,
  from `parallelisms.activation_checkpoint.saved_activation_bytes` run on a copy of
  that block with fake tensors at the real local shapes and dtype, times the blocks
  this rank holds (selective: every Nth block full, the others none), times the
  microbatches a pipeline schedule keeps in flight;
- the final norm + output head + loss ("logits/loss"): what it keeps for backward and
  its peak in forward and backward, for the plain path (full [tokens, vocab] logits)
  and the chunked one, measured by running it on fake tensors under `LiveBytesTracker`
  (a dispatch mode that follows storages and their peak);
- transients of one block's backward (recompute under AC, gradient buffers), also
  measured with `LiveBytesTracker`;
- the peak: persistent state (params + optimizer states) plus the largest of the step's
  phases: forward end, loss backward, block backward, optimizer step.

Compute dtype: FSDP's `mixed_precision_param` (bf16 on GPU); without FSDP (one rank,
TP/PP only) the model runs in fp32, and on CPU bf16 applies only with
`training.mixed_precision_on_cpu` (as in the trainer).

TP is modelled by shrinking the projections the Llama TP plan shards (wq/wk/wv/w1/w3
by output, wo/w2 by input) and, with sequence parallel, dividing the residual-stream
tensors (block inputs, norm inputs) by the TP degree. MoE under EP is modelled with
balanced routing (each rank's experts see local tokens x top_k rows in total).

`measure_step(args)` runs a real training step of the trainer in this process and
measures saved activation bytes (`SavedActivationCounter`) and the peak RSS growth;
`scripts/estimate_memory.py --validate` compares the two in fresh subprocesses.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GiB = 1024**3
MiB = 1024**2

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_TP_COLWISE = ("wq", "wk", "wv", "w1", "w3")
_TP_ROWWISE = ("wo", "w2")


# ---------------------------------------------------------------------------
# Live bytes on fake tensors
# ---------------------------------------------------------------------------

class LiveBytesTracker(TorchDispatchMode):
    """Follows every storage that an op creates while active, and the peak of their sum.

    A storage counts from the op that creates it until it is freed (its last tensor,
    including autograd's saved copies, is gone). Storages that existed before are not
    counted (parameters, inputs): add them yourself. Works on real, fake and meta
    tensors; only storage sizes are read. Kernel-internal workspaces are not seen.
    """

    def __init__(self):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef
        self._ref = StorageWeakRef
        self._live: dict = {}
        self.current = 0
        self.peak = 0

    def _refresh(self) -> None:
        self._live = {k: v for k, v in self._live.items() if not k.expired()}
        self.current = sum(self._live.values())
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                try:
                    st = t.untyped_storage()
                    key = self._ref(st)
                except Exception:  # noqa: BLE001 - storage-less tensors
                    continue
                if key not in self._live:
                    self._live[key] = int(st.nbytes())
        self._refresh()
        return out

    def sample(self) -> int:
        """Current live bytes, after dropping the storages freed since the last op."""
        self._refresh()
        return self.current

    def reset_peak(self) -> None:
        self._refresh()
        self.peak = self.current


# ---------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------

def default_world_size(par, gpus_per_node: int = 8, max_nodes: int = 4096) -> int:
    """The smallest multiple of `gpus_per_node` that the parallel degrees fit: explicit
    degrees must divide it, and EP must divide dp_shard x tp (the ranks it borrows)."""
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
        if (dp_shard * par.tensor_parallel_degree) % par.expert_parallel_degree:
            continue
        return world
    return fixed  # explicit degrees whose product is not a multiple of gpus_per_node


@dataclass
class Layout:
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


def resolve_layout(cfg, world_size: int) -> Layout:
    from parallelisms.parallel_dims import ParallelDims
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    par = cfg.parallelism
    return Layout(world=world_size, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp,
                  pp=dims.pp, ep=dims.ep, fsdp=dims.dp_shard * dims.cp > 1 or dims.dp_replicate > 1,
                  sequence_parallel=par.enable_sequence_parallel and dims.tp > 1,
                  loss_parallel=dims.tp > 1 and not par.disable_loss_parallel)


def compute_dtype(cfg, layout: Layout, device: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(dtype of the params the model runs with, autocast dtype or None), as the trainer
    resolves them: under FSDP its MixedPrecisionPolicy gathers params in
    `mixed_precision_param`; without FSDP the fp32 params run under autocast to it."""
    dtype = _DTYPES[cfg.training.mixed_precision_param]
    if device == "cpu" and not cfg.training.mixed_precision_on_cpu:
        dtype = torch.float32
    if layout.fsdp or dtype == torch.float32:
        return dtype, None
    return torch.float32, dtype


# ---------------------------------------------------------------------------
# Parameter accounting
# ---------------------------------------------------------------------------

def _is_expert(name: str) -> bool:
    return ".experts." in f".{name}" or name.startswith("experts.")


def _tp_sharded(name: str, param: torch.Tensor, tp: int) -> tuple[int, ...]:
    """Local shape of a parameter under the TP plan (Llama names; others: replicated)."""
    shape = tuple(param.shape)
    if tp == 1 or param.dim() != 2:
        return shape
    parts = name.split(".")
    mod = parts[-2] if len(parts) >= 2 else ""
    if mod in _TP_COLWISE or name in ("output.weight",):
        return (math.ceil(shape[0] / tp),) + shape[1:]
    if name == "tok_embeddings.weight":
        return (math.ceil(shape[0] / tp),) + shape[1:]
    if mod in _TP_ROWWISE:
        return (shape[0], math.ceil(shape[1] / tp))
    return shape


def _local_numel(name: str, param: torch.Tensor, layout: Layout) -> int:
    if _is_expert(name):
        # Experts: sharded over EP, then FSDP over the rest of dp_shard x tp.
        shards = layout.dp_shard * layout.cp * layout.tp
        shape = tuple(param.shape)
    else:
        shards = layout.dp_shard * layout.cp
        shape = _tp_sharded(name, param, layout.tp)
    if not shape:
        return 1
    rows = math.ceil(shape[0] / shards) if layout.fsdp else shape[0]
    return rows * math.prod(shape[1:])


def _unit_names(model: nn.Module) -> dict[str, list[str]]:
    """FSDP units (as apply_fsdp wraps them) -> parameter names."""
    units: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        if name.startswith("layers."):
            unit = ".".join(name.split(".")[:2])
        elif name.startswith(("norm.", "output.")):
            unit = "head"
        elif name.startswith("tok_embeddings."):
            unit = "tok_embeddings"
        else:
            unit = "root"
        units.setdefault(unit, []).append(name)
    return units


def _rank_stages(model: nn.Module, cfg, layout: Layout) -> list[list[list[str]]]:
    """For every PP rank, the module names of each stage it holds (no PP: one stage)."""
    names = [n for n, c in model.named_children() if c is not None and n != "layers"]
    if layout.pp == 1:
        return [[names + [f"layers.{k}" for k in model.layers.keys()]]]
    from parallelisms.parallel_dims import V_SCHEDULES
    from parallelisms.pipeline import split_stages, stage_ids_for_rank
    par = cfg.parallelism
    spr = par.pipeline_parallel_stages_per_rank
    fqns = par.module_fqns_per_model_part or split_stages(model, layout.pp * spr)
    v_style = par.pipeline_parallel_schedule in V_SCHEDULES
    return [[list(fqns[s]) for s in stage_ids_for_rank(r, layout.pp, spr, v_style)] for r in range(layout.pp)]


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


# ---------------------------------------------------------------------------
# Fake-tensor probes
# ---------------------------------------------------------------------------

def _fake_copy(module: nn.Module, dtype: torch.dtype, tp: int = 1) -> nn.Module:
    """A copy of a meta `module` whose params are fake CPU tensors in `dtype` (buffers keep
    theirs), with the TP-sharded projections shrunk to their local shape. Call under
    FakeTensorMode."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        m = copy.deepcopy(module)
    for mod_name, mod in m.named_modules():
        leaf = mod_name.split(".")[-1]
        for n, p in list(mod._parameters.items()):
            if p is None:
                continue
            shape = tuple(p.shape)
            if tp > 1 and p.dim() == 2 and n == "weight" and leaf in _TP_COLWISE:
                shape = (math.ceil(shape[0] / tp), shape[1])
            elif tp > 1 and p.dim() == 2 and n == "weight" and leaf in _TP_ROWWISE:
                shape = (shape[0], math.ceil(shape[1] / tp))
            mod._parameters[n] = nn.Parameter(torch.empty(shape, dtype=dtype if p.is_floating_point() else p.dtype),
                                              requires_grad=p.requires_grad)
        for n, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[n] = torch.zeros(b.shape, dtype=b.dtype)
        if isinstance(mod, nn.Linear):
            mod.in_features, mod.out_features = mod.weight.shape[1], mod.weight.shape[0]
    return m


@dataclass
class BlockProbe:
    saved: int  # bytes kept for backward (AC module's count)
    saved_breakdown: dict
    backward_extra: int  # peak live bytes during its backward above what forward left (incl. weight grads)
    weight_grad_bytes: int  # the block's weight gradients in the compute dtype
    expert_grad_bytes: int  # of which routed experts' (all experts: EP shards them)
    input_bytes: int  # one residual-stream tensor [mb, seq, dim]


def probe_block(block_meta: nn.Module, rope_meta: torch.Tensor, *, mode: str, batch: int, seq: int,
                dtype: torch.dtype, ac_cfg, extra_save_ops=(), force_recompute_fqns=(), tp: int = 1,
                layer_id: int = 0, autocast: torch.dtype | None = None, cp: int = 1,
                cp_method: str = "allgather") -> BlockProbe:
    """Saved bytes and backward transient of one block under `mode` (none/full/op) at
    [batch, seq, dim] with params in `dtype` (forward under `autocast` if given), with
    fake tensors. With `cp` > 1, `seq` is the rank's seq_len / cp and the block runs the
    CP plan's attention (gathered K/V or head-sharded q/k/v included)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.checkpoint import checkpoint

    from parallelisms.activation_checkpoint import op_sac_context_fn, saved_activation_bytes

    with FakeTensorMode(allow_non_fake_inputs=False):
        block = _fake_copy(block_meta, dtype, tp)
        if cp > 1:
            from parallelisms.context_parallel import CP_SAVE_OPS, install_memory_probe

            install_memory_probe(block, cp, cp_method)
            extra_save_ops = frozenset(extra_save_ops) | CP_SAVE_OPS
        dim = _model_dim(block_meta)
        x = torch.empty(batch, seq, dim, dtype=dtype, requires_grad=True)
        rope = torch.zeros(tuple(rope_meta.shape), dtype=rope_meta.dtype)[:seq]
        with _maybe_autocast(autocast):
            total, breakdown = saved_activation_bytes(block, x, rope, mode=mode, cfg=ac_cfg,
                                                      extra_save_ops=extra_save_ops,
                                                      force_recompute_fqns=force_recompute_fqns, layer_id=layer_id,
                                                      breakdown=True)
        # The backward's transients: forward as the trainer wraps it, then backward.
        ctx_fn = None
        if mode == "op":
            patterns = tuple(force_recompute_fqns) + tuple(ac_cfg.force_recompute_mm_fqns)
            ctx_fn = op_sac_context_fn(extra_save_ops=extra_save_ops, force_recompute_fqns=patterns, block=block,
                                       prefix=f"layers.{layer_id}")
        try:
            with LiveBytesTracker() as tracker:
                with _maybe_autocast(autocast):
                    if mode == "none":
                        out = block(x, rope)
                    elif mode == "full":
                        out = checkpoint(block, x, rope, use_reentrant=False, preserve_rng_state=False)
                    else:
                        out = checkpoint(block, x, rope, use_reentrant=False, preserve_rng_state=False,
                                         context_fn=ctx_fn)
                grad_out = torch.empty_like(out)
                after_forward = tracker.sample()
                tracker.reset_peak()
                out.backward(grad_out)
                peak = tracker.peak
        finally:
            if ctx_fn is not None:
                ctx_fn.scope.remove()
        wgrad = sum(p.numel() * p.element_size() for p in block.parameters())
        egrad = sum(p.numel() * p.element_size() for n, p in block.named_parameters() if _is_expert(n))
        inp = x.numel() * x.element_size()
    return BlockProbe(saved=int(total), saved_breakdown=dict(breakdown), backward_extra=int(peak - after_forward),
                      weight_grad_bytes=int(wgrad), expert_grad_bytes=int(egrad), input_bytes=int(inp))


def _maybe_autocast(dtype: torch.dtype | None):
    import contextlib
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _model_dim(module: nn.Module) -> int:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            return m.in_features
    raise ValueError("cannot infer the model dim")


@dataclass
class HeadProbe:
    saved: int  # kept for backward by final norm + output + loss
    forward_peak: int  # peak live bytes in its forward (incl. its input hidden state)
    backward_peak: int  # peak in its backward (saved + grads + temporaries, incl. input)
    after_backward: int  # left alive after backward: its weight grads and the input's grad
    weight_grad_bytes: int


def probe_head(norm_meta: nn.Module, output_meta: nn.Module, *, batch: int, seq: int, dtype: torch.dtype,
               chunked: bool, chunk_size: int, tp_vocab: int = 1, autocast: torch.dtype | None = None) -> HeadProbe:
    """Final norm + output projection + loss (plain or chunked) on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from parallelisms.activation_checkpoint import SavedActivationCounter
    from trainer.loss import chunked_linear_cross_entropy, cross_entropy_sum

    vocab, dim = output_meta.weight.shape
    vocab = math.ceil(vocab / tp_vocab)
    with FakeTensorMode():
        norm = _fake_copy(norm_meta, dtype)
        weight = nn.Parameter(torch.empty(vocab, dim, dtype=dtype))
        x = torch.empty(batch, seq, dim, dtype=dtype, requires_grad=True)
        labels = torch.zeros(batch, seq, dtype=torch.long)
        x_bytes = x.numel() * x.element_size()
        with LiveBytesTracker() as tracker:
            with SavedActivationCounter(list(norm.parameters()) + [weight]) as counter, _maybe_autocast(autocast):
                h = norm(x)
                if chunked:
                    loss = chunked_linear_cross_entropy(h, weight, labels, chunk_size)
                else:
                    loss = cross_entropy_sum(torch.nn.functional.linear(h, weight), labels)
                del h
            forward_peak = tracker.peak
            tracker.reset_peak()
            loss.backward()
            backward_peak = tracker.peak
            del loss
            after = tracker.sample()
        wgrad = weight.numel() * weight.element_size() + sum(p.numel() * p.element_size() for p in norm.parameters())
    return HeadProbe(saved=counter.total_bytes, forward_peak=forward_peak + x_bytes,
                     backward_peak=backward_peak + x_bytes, after_backward=after, weight_grad_bytes=int(wgrad))


# ---------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------

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
    loss_peak_other: int  # the same for the other CE path (for comparison)
    block_backward: int  # transient of one block's backward (recompute + grad buffers)
    optimizer_step: int  # optimizer temporaries (foreach AdamW: one fp32 copy of the params)
    phases: dict = field(default_factory=dict)  # step phase -> bytes above the persistent state
    notes: list = field(default_factory=list)

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
    def saved_activations(self) -> int:
        """Everything kept for backward in one microbatch's forward (blocks + head/loss)."""
        return self.activations + self.loss_saved

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(persistent=self.persistent, step_peak=self.step_peak, total=self.total,
                 saved_activations=self.saved_activations)
        return d


def _ac_kind_modes(mode: str, layer_ids: list[int], interval: int) -> dict[int, str]:
    if mode == "selective":
        return {i: ("full" if i % interval == 0 else "none") for i in layer_ids}
    return {i: mode for i in layer_ids}


def estimate_memory(cfg, world_size: int | None = None, *, device: str = "cuda", gpus_per_node: int = 8,
                    config_name: str = "") -> MemoryEstimate:
    """Per-rank memory of a training step of `cfg` (a JobConfig) on `world_size` ranks."""
    from trainer.configurable import ConfigError
    from trainer.model_args import model_label

    world = world_size or default_world_size(cfg.parallelism, gpus_per_node)
    layout = resolve_layout(cfg, world)
    if cfg.model_args is None:  # a JobConfig built in code, not by load_config
        cfg.validate()
    spec, args = cfg.model_spec, cfg.model_args
    with torch.device("meta"):
        model = spec.model_cls(args)
    t, par, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    mode = ac.mode
    if mode == "memory_budget":
        raise ConfigError("config error: activation_checkpoint.mode: memory_budget is chosen by the compile "
                          "partitioner and has no eager count; estimate with none/full/op instead")
    dtype, autocast = compute_dtype(cfg, layout, device)
    esize = torch.tensor([], dtype=dtype).element_size()
    notes: list[str] = []

    # ---- batch and layout of blocks ----
    if layout.pp > 1:
        mb = par.pipeline_parallel_microbatch_size
        n_mb = t.local_batch_size // mb
    else:
        mb, n_mb = t.local_batch_size, 1
    seq = t.seq_len // layout.cp  # the tokens of each sequence this rank holds (context parallel)
    grad_accum = 1
    if t.global_batch_size > 0:
        grad_accum = max(1, t.global_batch_size // (t.local_batch_size * layout.dp_replicate * layout.dp_shard))
    rank_stages = _rank_stages(model, cfg, layout)

    # ---- parameters per rank (the PP rank with the most) ----
    params = dict(model.named_parameters())
    units = _unit_names(model)

    def local_bytes(names, nbytes=4):
        return sum(_local_numel(n, params[n], layout) for n in names) * nbytes

    def stage_param_names(stage):
        out = []
        for mod in stage:
            out += [n for n in params if n == mod or n.startswith(mod + ".")]
        return out

    best = None
    for r, stages in enumerate(rank_stages):
        names = [n for s in stages for n in stage_param_names(s)]
        b = local_bytes(names)
        if best is None or b > best[0]:
            best = (b, r, names)
    p_bytes, heavy_rank, rank_names = best
    opt_states = 2 if cfg.optimizer.name in ("AdamW", "Adam") else 0
    grads = p_bytes
    optimizer = opt_states * p_bytes
    offload = layout.fsdp and par.fsdp_cpu_offload
    if offload:
        notes.append("fsdp_cpu_offload: sharded params, grads and optimizer states live in host memory (not counted)")

    # ---- activations per block, at the real local shapes ----
    layer_ids_rank0 = [int(m.split(".")[1]) for s in rank_stages[0] for m in s if m.startswith("layers.")]
    all_layers = [int(k) for k in model.layers.keys()]
    modes = _ac_kind_modes(mode, all_layers, ac.selective_layer_interval)
    rope = model.rope_cache
    probes: dict[tuple, BlockProbe] = {}
    kind_of: dict[int, tuple] = {}
    for lid in all_layers:
        blk = model.layers[str(lid)]
        sig = tuple((n, tuple(p.shape)) for n, p in blk.named_parameters())
        kind = (sig, modes[lid])
        kind_of[lid] = kind
        if kind not in probes:
            probes[kind] = probe_block(blk, rope, mode=modes[lid], batch=mb, seq=seq, dtype=dtype, ac_cfg=ac,
                                       extra_save_ops=spec.sac_save_ops,
                                       force_recompute_fqns=spec.sac_force_recompute_fqns, tp=layout.tp,
                                       layer_id=lid, autocast=autocast, cp=layout.cp,
                                       cp_method=par.context_parallel_method)
    # EP: the probed block holds all routed experts; this rank holds E/ep of them. The
    # expert-sized part of the backward transient (weight grads and their temporaries) is
    # found from a second probe with E/2 experts and scaled linearly to E/ep.
    ep_extra: dict[tuple, int] = {}
    if layout.ep > 1:
        for lid in all_layers:
            kind = kind_of[lid]
            if kind in ep_extra or probes[kind].expert_grad_bytes == 0:
                continue
            ep_extra[kind] = _ep_local_backward_extra(model.layers[str(lid)], args, lid, probes[kind], rope, mb, seq,
                                                      dtype, ac, spec, layout, modes[lid], notes, autocast)
    # Sequence parallel: the residual stream (block inputs, norm inputs) is sharded over TP.
    sp_div = layout.tp if layout.sequence_parallel else 1

    def block_saved(lid: int) -> int:
        pr = probes[kind_of[lid]]
        if sp_div == 1:
            return pr.saved
        m = modes[lid]
        if m == "full":
            return pr.saved // sp_div
        # none/op: the block input (and, for none, the two norm inputs) are sequence-sharded.
        n_resid = 1 if m == "op" else 3
        return pr.saved - n_resid * pr.input_bytes * (sp_div - 1) // sp_div

    per_block = {}
    names_by_sig = {}
    for lid in all_layers:
        sig, m = kind_of[lid]
        label = "moe" if any(_is_expert(n) for n, _ in sig) else "dense"
        names_by_sig.setdefault((label, m), block_saved(lid))
    for (label, m), b in names_by_sig.items():
        per_block[f"{m}/{label}"] = b

    # Rank 0's blocks with its schedule's in-flight microbatches (PP), else all blocks.
    in_flight_units = _in_flight_units(par.pipeline_parallel_schedule, layout.pp,
                                       par.pipeline_parallel_stages_per_rank, n_mb)
    stage_blocks = [[int(m.split(".")[1]) for m in s if m.startswith("layers.")] for s in rank_stages[0]]
    stage_bytes = [sum(block_saved(i) for i in blocks) for blocks in stage_blocks]
    if layout.pp > 1:
        per_unit = max(stage_bytes)
        activations = per_unit * in_flight_units
        in_flight = in_flight_units / len(stage_blocks)
    else:
        activations = sum(stage_bytes)
        in_flight = 1.0
    activations += mb * seq * 8  # the embedding keeps the token ids
    if device == "cpu" and layout.cp > 1:
        from parallelisms.context_parallel import cpu_mask_bytes

        activations += cpu_mask_bytes(t.seq_len, layout.cp, par.context_parallel_method, esize)
    blocks_on_rank = len(layer_ids_rank0)

    # ---- logits / loss ----
    tp_vocab = layout.tp if layout.loss_parallel else 1
    head_plain = probe_head(model.norm, model.output, batch=mb, seq=seq, dtype=dtype, chunked=False,
                            chunk_size=cfg.loss.ce_chunk_size, tp_vocab=tp_vocab, autocast=autocast)
    head_chunk = probe_head(model.norm, model.output, batch=mb, seq=seq, dtype=dtype, chunked=True,
                            chunk_size=cfg.loss.ce_chunk_size, tp_vocab=tp_vocab, autocast=autocast)
    head, other = (head_chunk, head_plain) if cfg.loss.chunked_ce else (head_plain, head_chunk)
    loss_peak = max(head.forward_peak, head.backward_peak)
    loss_peak_other = max(other.forward_peak, other.backward_peak)

    # ---- FSDP buffers (compute dtype) ----
    def unsharded_numel(n):  # what FSDP gathers on this rank: TP- and EP-local shapes
        if _is_expert(n):
            return params[n].numel() / layout.ep
        return math.prod(_tp_sharded(n, params[n], layout.tp))

    unit_bytes = {u: sum(unsharded_numel(n) for n in ns) * esize for u, ns in units.items()}
    block_units = [u for u in unit_bytes if u.startswith("layers.")]
    largest_block = max((unit_bytes[u] for u in block_units), default=0)
    fsdp_buffers = 0
    head_unit = unit_bytes.get("head", 0)
    if layout.fsdp:
        reshard = {"always": True, "never": False, "default": layout.pp == 1}[par.fsdp_reshard_after_forward]
        if reshard:
            # the unit running + the next one prefetched, and the norm+output unit kept gathered
            fsdp_buffers = int(2 * largest_block + (head_unit if par.fsdp_reshard_after_forward != "always" else 0))
        else:
            fsdp_buffers = int(sum(unit_bytes[u] for u in units if any(n in rank_names for n in units[u])))
        if dtype != torch.float32:
            fsdp_buffers += int(largest_block * 4 / esize)  # reduce-scatter input in fp32
        notes.append("FSDP buffers: gathered params of the running + prefetched unit and the kept norm+output "
                     "unit, in the compute dtype")

    # ---- phases (bytes above params + optimizer states) ----
    # grads alive before backward: none (zero_grad sets them to None), unless they
    # accumulate over microbatches (grad accumulation, PP).
    accum_grads = grads if (grad_accum > 1 or layout.pp > 1) else 0
    local_head_grad = local_bytes(units.get("head", []))
    phases = {}
    # Autocast (no FSDP) caches the low-precision copy of every weight it casts until the
    # forward+loss region ends; blocks without AC save those copies anyway (counted above).
    autocast_cache = 0
    if autocast is not None:
        csize = torch.tensor([], dtype=autocast).element_size()
        autocast_cache = sum(math.prod(_tp_sharded(n, params[n], layout.tp)) * csize for lid in layer_ids_rank0
                             if modes[lid] != "none" for n in units.get(f"layers.{lid}", []) if params[n].dim() == 2)
    phases["forward+loss"] = fsdp_buffers + accum_grads + activations + head.forward_peak + autocast_cache
    phases["loss backward"] = fsdp_buffers + accum_grads + activations + head.backward_peak
    # Backward through the blocks, last first: blocks before i still hold activations,
    # blocks after i hold their (local, fp32) grads; block i runs its backward transient.
    last_blocks = stage_blocks[-1] if stage_blocks else []
    worst_block = 0
    if last_blocks:
        pr_last = probes[kind_of[last_blocks[-1]]]
        head_grad_live = local_head_grad if layout.fsdp else head.weight_grad_bytes
        grad_in = pr_last.input_bytes
        worst_block = ep_extra.get(kind_of[last_blocks[-1]], pr_last.backward_extra)
        phases["block backward"] = (fsdp_buffers + accum_grads + activations + head_grad_live + grad_in +
                                    worst_block)
    opt_tmp = p_bytes if _optimizer_impl(cfg, device) == "foreach" else 0
    phases["optimizer step"] = grads + opt_tmp
    if layout.fsdp is False and layout.world > 1 and par.data_parallel_shard_degree == -1:
        notes.append(f"data_parallel_shard_degree -1 resolves to 1 on {world} ranks: no FSDP sharding (params, "
                     "grads and optimizer states replicated over the data-parallel ranks); pass --ngpu (e.g. several nodes) to lay the config out with FSDP")
    if offload:
        phases["optimizer step"] = 0
        p_bytes_gpu, grads, optimizer = 0, 0, 0
        p_bytes = p_bytes_gpu

    return MemoryEstimate(
        config=config_name, model=model_label(cfg), world_size=world, layout=layout,
        device=device, compute_dtype=str(autocast or dtype).replace("torch.", "") + (" (autocast)" if autocast else ""), ac_mode=mode, chunked_ce=cfg.loss.chunked_ce,
        tokens_per_microbatch=mb * seq, blocks_on_rank=blocks_on_rank, in_flight_microbatches=in_flight,
        params=int(p_bytes), grads=int(grads), optimizer=int(optimizer), fsdp_buffers=int(fsdp_buffers),
        activations_per_block=per_block, activations=int(activations), loss_saved=int(head.saved),
        loss_peak=int(loss_peak), loss_peak_other=int(loss_peak_other), block_backward=int(worst_block),
        optimizer_step=int(opt_tmp), phases={k: int(v) for k, v in phases.items()}, notes=notes)


def _ep_local_backward_extra(block, args, lid, probe: BlockProbe, rope, mb, seq, dtype, ac, spec, layout,
                             mode, notes, autocast=None) -> int:
    n_exp = getattr(args, "n_routed_experts", None)
    half = n_exp // 2 if n_exp else 0
    groups = getattr(args, "n_expert_groups", 1) or 1
    ok = bool(half) and half % groups == 0 and \
        args.n_activated_experts <= half // groups * min(groups, getattr(args, "n_limited_groups", groups) or groups)
    if ok:
        with torch.device("meta"):
            half_block = type(block)(lid, dataclasses.replace(args, n_routed_experts=half))
        pr2 = probe_block(half_block, rope, mode=mode, batch=mb, seq=seq, dtype=dtype, ac_cfg=ac,
                          extra_save_ops=spec.sac_save_ops, force_recompute_fqns=spec.sac_force_recompute_fqns,
                          tp=layout.tp, layer_id=lid, autocast=autocast)
        per_expert = (probe.backward_extra - pr2.backward_extra) / (n_exp - half)
        return int(max(0, probe.backward_extra - per_expert * (n_exp - n_exp / layout.ep)))
    notes.append("EP: could not re-probe a block with fewer experts; subtracted only the non-local expert grads")
    return int(max(0, probe.backward_extra - probe.expert_grad_bytes * (layout.ep - 1) / layout.ep))


def _optimizer_impl(cfg, device: str) -> str:
    impl = cfg.optimizer.implementation
    if impl == "auto":
        impl = "fused" if device == "cuda" else "foreach"
    return impl


def fmt_bytes(n: float) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"


def format_estimate(est: MemoryEstimate) -> str:
    L = est.layout
    lines = [
        f"memory estimate: {est.model}{' (' + est.config + ')' if est.config else ''}, per rank, {est.device}",
        f"  world {est.world_size}: dp_replicate {L.dp_replicate} x dp_shard {L.dp_shard} x cp {L.cp} x tp {L.tp} x pp {L.pp}"
        f" (ep {L.ep}); compute dtype {est.compute_dtype}{' (FSDP mixed precision)' if L.fsdp else ''}",
        f"  tokens per microbatch {est.tokens_per_microbatch}; AC {est.ac_mode}; chunked CE "
        f"{'on' if est.chunked_ce else 'off'}; blocks on the busiest rank {est.blocks_on_rank}"
        + (f"; in-flight microbatches {est.in_flight_microbatches:g}" if L.pp > 1 else ""),
        "",
        f"  {'parameters (fp32, sharded)':<44}{fmt_bytes(est.params):>12}",
        f"  {'gradients (fp32, sharded)':<44}{fmt_bytes(est.grads):>12}",
        f"  {'optimizer states (AdamW: 2 x fp32)':<44}{fmt_bytes(est.optimizer):>12}",
        f"  {'FSDP gathered params / reduce buffers':<44}{fmt_bytes(est.fsdp_buffers):>12}",
    ]
    for k, v in est.activations_per_block.items():
        lines.append(f"  {'activations per block (' + k + ')':<44}{fmt_bytes(v):>12}")
    lines += [
        f"  {'activations, all blocks on this rank':<44}{fmt_bytes(est.activations):>12}",
        f"  {'logits/loss: kept for backward':<44}{fmt_bytes(est.loss_saved):>12}",
        f"  {'logits/loss: peak (' + ('chunked' if est.chunked_ce else 'plain') + ' CE)':<44}"
        f"{fmt_bytes(est.loss_peak):>12}",
        f"  {'logits/loss: peak with chunked CE ' + ('off' if est.chunked_ce else 'on'):<44}"
        f"{fmt_bytes(est.loss_peak_other):>12}",
        f"  {'one block backward (recompute + grads)':<44}{fmt_bytes(est.block_backward):>12}",
        f"  {'optimizer step temporaries':<44}{fmt_bytes(est.optimizer_step):>12}",
        "",
        "  step phases (on top of params + optimizer states):",
    ]
    for k, v in est.phases.items():
        mark = "  <- peak" if v == est.step_peak else ""
        lines.append(f"    {k:<42}{fmt_bytes(v):>12}{mark}")
    lines += [
        "",
        f"  {'TOTAL (estimated peak per rank)':<44}{fmt_bytes(est.total):>12}",
    ]
    for n in est.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Measuring a real step (validation)
# ---------------------------------------------------------------------------

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:  # noqa: BLE001
        pass


class _PeakSampler:
    """Samples RSS from /proc/self/statm in a thread (fallback when VmHWM cannot be reset)."""

    def __init__(self, interval_s: float = 0.0005):
        import threading
        self.interval = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self):
        self.peak = _rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def measure_step(argv: list[str]) -> dict:
    """Builds the trainer for `argv` in this process, runs one warm-up step (counting
    the activation bytes saved for backward with the AC module's counter: autograd
    saved tensors + SAC cache), then measures the peak RSS growth of one more step
    above a baseline taken after the warm-up with gradients freed (params + optimizer
    states resident). Run it in a fresh process with a fixed glibc mmap threshold
    (see `scripts/estimate_memory.py --validate`) so that frees return memory."""
    from parallelisms.activation_checkpoint import SavedActivationCounter
    from trainer.config import load_config
    from trainer.train import Trainer

    cfg = load_config(argv)
    trainer = Trainer(cfg)
    try:
        parts = trainer.model_parts
        exclude = [t for p in parts for t in list(p.parameters()) + list(p.buffers())]
        batches = trainer.next_microbatches()
        with SavedActivationCounter(exclude) as counter:
            trainer.train_step(batches)
        saved = counter.total_bytes
        saved_breakdown = dict(counter.bytes_by_source)
        del counter, exclude
        batches = trainer.next_microbatches()
        for opt in trainer.optimizers:
            opt.zero_grad(set_to_none=True)
        gc.collect()
        _malloc_trim()
        base = _rss_bytes()
        hwm_ok = _reset_hwm()
        with _PeakSampler() as sampler:
            trainer.train_step(batches)
        hwm = _hwm_bytes() if hwm_ok else None
        peak = max(sampler.peak, hwm or 0)
        persistent = sum(t.numel() * t.element_size() for p in parts for t in _local_tensors(p.parameters()))
        persistent += sum(t.numel() * t.element_size() for o in trainer.optimizers for st in o.state.values()
                          for t in _local_tensors(v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0))
        return {"saved_bytes": int(saved), "saved_breakdown": saved_breakdown, "rss_base": base, "rss_peak": peak,
                "peak_growth": int(peak - base), "hwm_used": hwm is not None, "sampler_peak": sampler.peak,
                "persistent_bytes": int(persistent), "rank": trainer.rank}
    finally:
        trainer.close()


def _local_tensors(tensors):
    for t in tensors:
        yield t.to_local() if hasattr(t, "to_local") else t


# ---------------------------------------------------------------------------
# Validation: estimate vs measurement
# ---------------------------------------------------------------------------

# glibc: serve every allocation above 64 KiB with its own mmap and give it back on free
# (a fixed threshold also stops glibc from raising it after frees), one arena, so that
# RSS follows the live bytes instead of the allocator's cache.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1",
              "OMP_NUM_THREADS": "1"}


@dataclass
class ValidationCase:
    name: str
    argv: list  # trainer CLI args
    nproc: int = 1


def run_measurements(cases: list[ValidationCase], workdir: str, timeout: int = 300) -> dict[str, list[dict]]:
    """Runs `measure_step` for every case in fresh processes with MALLOC_ENV: the
    single-rank cases one after the other in one process (each measures its own
    baseline after its warm-up, and the fixed mmap threshold returns the previous
    case's memory), each multi-rank case under its own torchrun. Returns, per case
    name, one result per rank."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(repo)}
    results: dict[str, list[dict]] = {}
    single = [c for c in cases if c.nproc == 1]
    groups = ([single] if single else []) + [[c] for c in cases if c.nproc > 1]
    for gi, group in enumerate(groups):
        spec_path = Path(workdir) / f"cases{gi}.json"
        spec_path.write_text(json.dumps([
            {"name": c.name, "argv": list(c.argv) + ["--job.dump_folder", str(Path(workdir) / c.name)],
             "out": str(Path(workdir) / f"{c.name}.json")} for c in group]))
        nproc = group[0].nproc
        cmd = [sys.executable, "-m", "trainer.memory", "--measure-cases", str(spec_path)]
        if nproc > 1:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", *cmd[1:]]
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"measurement of {[c.name for c in group]} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        for c in group:
            out = Path(workdir) / f"{c.name}.json"
            results[c.name] = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(c.nproc)]
    return results


def validate_cases(cases: list[ValidationCase], workdir: str, timeout: int = 300) -> list[dict]:
    """Estimate (cpu, world = nproc) vs measurement (worst rank) for each case."""
    from trainer.config import load_config

    measured = run_measurements(cases, workdir, timeout)
    rows = []
    for case in cases:
        est = estimate_memory(load_config(list(case.argv)), case.nproc, device="cpu")
        ranks = measured[case.name]
        m = max(ranks, key=lambda r: r["peak_growth"])
        saved = max(r["saved_bytes"] for r in ranks)
        measured_total = m["persistent_bytes"] + m["peak_growth"]
        rows.append({
            "case": case.name, "nproc": case.nproc, "ac": est.ac_mode, "chunked_ce": est.chunked_ce,
            "est_saved": est.saved_activations, "meas_saved": saved,
            "saved_err": est.saved_activations / saved - 1,
            "est_step_peak": est.step_peak, "meas_peak_growth": m["peak_growth"],
            "peak_err": est.step_peak / m["peak_growth"] - 1,
            "est_total": est.total, "meas_total": measured_total, "total_err": est.total / measured_total - 1,
            "peak_phase": max(est.phases, key=est.phases.get), "hwm_used": m["hwm_used"],
        })
    return rows


def format_validation(rows: list[dict]) -> str:
    head = (f"{'case':<22}{'ranks':>5} {'saved est':>10} {'saved meas':>10} {'err':>7}  "
            f"{'step peak est':>13} {'RSS growth':>10} {'err':>7}  {'total est':>10} {'total meas':>10} {'err':>7}"
            f"  peak phase")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['case']:<22}{r['nproc']:>5} {r['est_saved'] / MiB:>8.1f}Mi {r['meas_saved'] / MiB:>8.1f}Mi "
            f"{r['saved_err'] * 100:>+6.1f}%  {r['est_step_peak'] / MiB:>11.1f}Mi {r['meas_peak_growth'] / MiB:>8.1f}Mi "
            f"{r['peak_err'] * 100:>+6.1f}%  {r['est_total'] / MiB:>8.1f}Mi {r['meas_total'] / MiB:>8.1f}Mi "
            f"{r['total_err'] * 100:>+6.1f}%  {r['peak_phase']}")
    return "\n".join(lines)


def _measure_main(spec_path: str) -> int:
    import json
    for case in json.loads(open(spec_path).read()):
        result = measure_step(case["argv"])
        with open(f"{case['out']}.rank{result['rank']}", "w") as f:
            json.dump(result, f)
        gc.collect()
        _malloc_trim()
    return 0


if __name__ == "__main__":
    import sys
    if len(sys.argv) == 3 and sys.argv[1] == "--measure-cases":
        sys.exit(_measure_main(sys.argv[2]))
    print("usage: python -m trainer.memory --measure-cases CASES.json  (see scripts/estimate_memory.py --validate)")
    sys.exit(2)
