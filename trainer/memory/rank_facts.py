"""What an estimate reads off assembled ranks: parameters and FSDP units, and the probes.

Why a module of its own: two readers share it. `read_every_rank` assembles every PP rank
as the trainer would (the reference path); `trainer.memory.estimate_cache.EstimateCache`
assembles only the ranks it has not seen the like of and reuses probes between
estimates (the planner's path). Both return a `RankFacts`, which `estimate_memory` turns
into an estimate, so the two can be compared byte for byte (tests/test_memory_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from trainer.memory.assemble import Layout, assemble_rank, chunked_ce_allowed
from trainer.memory.device_overhead import nccl_communicators
from trainer.memory.probes import (
    balanced_experts,
    fsdp_states,
    is_expert,
    probe_block,
    probe_head,
    shard,
    strip_fsdp,
    tensor_bytes,
    use_memory_probes,
)
from trainer.muon import clean_name

# ---------------------------------------------------------------------------
# Reading the assembled rank
# ---------------------------------------------------------------------------

@dataclass
class RankParams:
    """What one PP rank's assembled parts hold, before any probe runs."""

    param_bytes: int  # fp32 local shards of every parameter
    unit_bytes: dict  # FSDP unit -> its gathered size in the compute dtype ("layers.K" units with nested ones)
    head_param_bytes: int  # local fp32 shards of the final norm + output head
    matrix_numel: dict  # layer id -> its 2-D weights' local elements (what autocast casts)
    fsdp_param_bytes: int = 0  # the part of param_bytes FSDP manages (its units' local shards)
    # >= 2-D parameter (wrapper prefixes removed) -> (local shape, global shape, ranks sharding its
    # last two dims, ranks replicating it): what the optimizer terms read (trainer/memory/optimizer_terms.py)
    matrices: dict = field(default_factory=dict)
    layer_param_bytes: dict = field(default_factory=dict)  # layer id -> its local fp32 shards (its grads' bytes)
    early_param_bytes: int = 0  # local shards of modules whose backward precedes the blocks' but the head (MTP)


def _layer_key(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else name


def top_module(name: str) -> str:
    """The model-level module a parameter or FSDP unit name belongs to: "layers.K",
    "tok_embeddings", "norm", ... ("" for the part itself)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


def read_modules(part) -> dict[str, RankParams]:
    """One assembled part's reading, split by `top_module` (each FSDP unit goes to the
    module its first wrapped module belongs to; norm + output's unit to "norm")."""
    out: dict[str, RankParams] = {}

    def of(name: str) -> RankParams:
        return out.setdefault(top_module(name), RankParams(0, {}, 0, {}))

    for name, p in part.named_parameters():
        r = of(name)
        r.param_bytes += tensor_bytes([p])
        if name.startswith(("norm.", "output.")):
            r.head_param_bytes += tensor_bytes([p])
        if name.startswith("layers."):
            lid = int(name.split(".")[1])
            r.layer_param_bytes[lid] = r.layer_param_bytes.get(lid, 0) + tensor_bytes([p])
        if name.startswith("mtp."):
            r.early_param_bytes += tensor_bytes([p])
        if name.startswith("layers.") and p.dim() == 2:
            lid = int(name.split(".")[1])
            r.matrix_numel[lid] = r.matrix_numel.get(lid, 0) + shard(p).numel()
        if p.dim() >= 2:
            r.matrices[clean_name(name)] = matrix_layout(p)
    for name, state in fsdp_states(part).items():
        # FSDP all-gathers each parameter's padded shard from every rank of its shard mesh.
        fsdp_params = [fp for group in state._fsdp_param_groups for fp in group.fsdp_params]
        gathered = sum(fp.padded_sharded_param_size.numel() * fp.mesh_info.shard_mesh_size for fp in fsdp_params)
        of(name).fsdp_param_bytes += tensor_bytes([fp.sharded_param for fp in fsdp_params])
        key = "head" if name in ("norm", "output") else _layer_key(name)
        units = of(name).unit_bytes
        units[key] = units.get(key, 0) + gathered
    return out


def matrix_layout(p) -> tuple:
    """(local shape, global shape, ranks among which each matrix is split, ranks that hold the
    same ones) of a parameter."""
    from parallelisms.muon_assembly import matrix_replicas, matrix_shard_ranks

    return tuple(shard(p).shape), tuple(p.shape), matrix_shard_ranks(p), matrix_replicas(p)


def merge_params(readings) -> RankParams:
    """The sum of several readings (modules of a part, parts of a rank)."""
    units: dict = {}
    matrix: dict = {}
    matrices: dict = {}
    layers: dict = {}
    for r in readings:
        matrices.update(r.matrices)
        for k, v in r.layer_param_bytes.items():
            layers[k] = layers.get(k, 0) + v
        for k, v in r.unit_bytes.items():
            units[k] = units.get(k, 0) + v
        for k, v in r.matrix_numel.items():
            matrix[k] = matrix.get(k, 0) + v
    return RankParams(sum(r.param_bytes for r in readings), units, sum(r.head_param_bytes for r in readings), matrix,
                      sum(r.fsdp_param_bytes for r in readings), matrices, layers,
                      sum(r.early_param_bytes for r in readings))


def read_params(parts) -> RankParams:
    """What this rank's assembled parts hold: local parameter shards and FSDP units."""
    return merge_params([r for part in parts for r in read_modules(part).values()])


# ---------------------------------------------------------------------------
# Probing the assembled rank
# ---------------------------------------------------------------------------

@dataclass
class BlockReadout:
    probes: dict  # kind -> BlockProbe
    kind_of: dict  # layer id -> kind
    label_of: dict  # kind -> "mode/dense" or "mode/moe"
    embedding_saved: int


def probe_blocks(rank, cfg, layout: Layout, mb: int, receive_factor: float = 1.0,
                 want: Callable[[int], bool] | None = None, warm: bool = True) -> BlockReadout:
    """Probes every distinct block of this rank's parts (same local parameter shapes, AC
    mode and input), and what the embedding keeps. `receive_factor`: EP ranks receive that
    many times the balanced rows (the busiest rank of a skewed routing). `want(layer id)`:
    probe only those blocks (the others' kinds are still recorded); None: all. `warm`:
    keep a block's second call (the first may calibrate its AC policy); False: its first."""
    from parallelisms.ac_measure import SavedActivationCounter
    from parallelisms.activation_checkpoint import block_mode

    seq = cfg.training.seq_len
    dtype = rank.stream_dtype
    probes: dict = {}
    kind_of: dict = {}
    label_of: dict = {}
    embedding_saved = 0
    with rank.fake_mode:
        for part in rank.parts:
            balanced_experts(part, receive_factor)
            use_memory_probes(part)
            # DecoderLM.forward hands the blocks a view of the fp32 RoPE table (no copy).
            rope = part.rope_cache[: layout.token_seq(seq)]
            for i, (key, block) in enumerate(part.layers.items()):
                lid = int(key)
                # A stage without the embedding receives the full hidden state (the pipeline
                # sends plain tensors); otherwise the residual stream is this rank's shard.
                rows = layout.token_seq(seq) if i == 0 and part.tok_embeddings is None \
                    else layout.residual_seq(seq)
                shape = (mb, rows, cfg.model_args.dim)
                mode = block_mode(cfg.activation_checkpoint, lid)
                sig = tuple((n, tuple(shard(p).shape), p.dtype) for n, p in block.named_parameters())
                kind = (sig, mode, shape)
                kind_of[lid] = kind
                if kind not in probes and (want is None or want(lid)):
                    strip_fsdp(part, block)
                    probe = probe_block if warm else probe_block.once
                    probes[kind] = probe(block, rope, input_shape=shape, dtype=dtype,
                                         autocast=rank.precision.autocast, constants=(part.rope_cache, rope))
                    label_of[kind] = f"{mode}/{'moe' if any(is_expert(n) for n, *_ in sig) else 'dense'}"
            if part.tok_embeddings is not None:
                strip_fsdp(part, part.tok_embeddings)
                tokens = torch.zeros(mb, layout.token_seq(seq), dtype=torch.long)
                with SavedActivationCounter(list(part.tok_embeddings.parameters())) as counter:
                    part.tok_embeddings(tokens)
                embedding_saved += counter.total_bytes
    return BlockReadout(probes, kind_of, label_of, embedding_saved)


def probe_heads(rank, cfg, layout: Layout, mb: int) -> tuple:
    """(this config's loss path, the other one or None where it is refused) on the part
    holding the output head."""
    seq = cfg.training.seq_len
    dtype = rank.stream_dtype
    part = next(p for p in rank.parts if p.output is not None)
    kwargs = dict(input_shape=(mb, layout.residual_seq(seq), cfg.model_args.dim),
                  labels_shape=(mb, layout.token_seq(seq)), dtype=dtype, autocast=rank.precision.autocast,
                  loss_parallel=layout.loss_parallel)
    with rank.fake_mode:
        strip_fsdp(part, part.norm, part.output)
        ours = probe_head(part, chunked=cfg.loss.chunked_ce, **kwargs)
        other = probe_head(part, chunked=not cfg.loss.chunked_ce, **kwargs) if chunked_ce_allowed(cfg) else None
    return ours, other



@dataclass
class RankFacts:
    """Everything an estimate reads off the assembled ranks of one config."""

    per_rank: list  # RankParams of every PP rank, in rank order
    communicators: int  # rank 0's NCCL communicators (trainer/memory/device_overhead.py)
    precision: object  # rank 0's parallelisms.apply.Precision
    stage_layers: list  # rank 0's block ids, per model part
    dtype: torch.dtype  # the residual stream's dtype
    blocks: BlockReadout  # rank 0's blocks and embedding
    heads: tuple  # (this loss path, the other or None) of the head's part
    skewed: BlockReadout | None  # rank 0's blocks at the EP-skewed receive factor (None: not asked)


def read_every_rank(cfg, world: int, layout: Layout, mb: int, device: str, skew: float | None) -> RankFacts:
    """Assembles every PP rank (probes on rank 0, the head where it lives) and, for `skew`,
    rank 0 once more with its EP ranks receiving `skew` x the balanced rows."""
    per_rank: list[RankParams] = []
    blocks = heads = None
    for pp_rank in range(layout.pp):
        with assemble_rank(cfg, world, pp_rank=pp_rank, device=device) as rank:
            per_rank.append(read_params(rank.parts))
            if pp_rank == 0:
                communicators = nccl_communicators()
                precision, stage_layers, dtype = rank.precision, rank.stage_layer_ids, rank.stream_dtype
                blocks = probe_blocks(rank, cfg, layout, mb)
            if heads is None and any(p.output is not None for p in rank.parts):
                heads = probe_heads(rank, cfg, layout, mb)
    skewed = None
    if skew is not None:
        with assemble_rank(cfg, world, pp_rank=0, device=device) as rank:
            skewed = probe_blocks(rank, cfg, layout, mb, skew)
    return RankFacts(per_rank, communicators, precision, stage_layers, dtype, blocks, heads, skewed)
