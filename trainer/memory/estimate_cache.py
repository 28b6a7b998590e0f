"""A cache that lets many estimates share assemblies and probes (the planner's fast path).

Why: assembling one rank of a large model on fake tensors is what an estimate costs
(0.6-2 s per PP rank of DeepSeek V3 671B on a quiet 2-core CPU, every PP rank once), and
a layout search asks for hundreds of estimates that differ in a few settings. What each
reading depends on is narrower than the whole config, so each is kept under that key:

- a PP rank's parameters and FSDP units depend on the layout and the model, not on AC,
  batch sizes or the loss, and they are the sum of its modules' (each block, the
  embedding, norm + output; FSDP's root unit holds nothing). A module's reading depends
  only on the sharding degrees and the module's unsharded parameter shapes, not on pp,
  placement or the stage it sits in: a rank is assembled only while one of its modules is
  new for this sharding (rank 0 and the head's rank of the first pipeline layout), and
  every other rank's counts, of this layout or another pp, are summed from those. Where a
  stage is not the sum of its modules (root parameters, the user's own split), readings
  are kept per stage shape of the layout instead;
- a block's probe depends on its kind, AC mode, input shape and the layout without pp
  (dp_replicate, dp_shard, tp, cp, ep, sequence parallel, FSDP's compute dtype), not on pp,
  the schedule or the stage; the head's and the embedding's probes likewise, without AC;
- one assembly of rank 0 serves every batch size asked for together and the EP-skewed
  probe, and a block is probed once (the reference path keeps its second call), except
  under AC modes `budget` and `op`, whose policies learn on a block's first call: there
  each probe gets a fresh assembly and its warm-up call, and a block's probe is kept only
  with all of rank 0's kinds in order (the calibration history), as the reference path runs it.

The estimate is then computed from these readings by the same code as the reference path
(`trainer.memory.rank_facts.read_every_rank`); tests/test_memory_cache.py checks both give
equal bytes.
"""

from __future__ import annotations

import dataclasses

from trainer.memory.assemble import Layout, assemble_rank, assembly_config, chunked_ce_allowed, fake_world
from trainer.memory.device_overhead import nccl_communicators
from trainer.memory.probes import is_expert
from trainer.memory.rank_facts import (
    BlockReadout,
    RankFacts,
    RankParams,
    merge_params,
    probe_blocks,
    probe_heads,
    read_modules,
)

# Settings that neither the assembly nor a probe reads (the estimate reads some of them itself).
_UNREAD_SECTIONS = ("job", "data", "validation", "optimizer", "lr_scheduler", "checkpoint", "metrics", "profiling",
                    "comm", "fault_tolerance")
_BATCH = dict(local_batch_size=0, global_batch_size=0, steps=0)
_PIPELINE_AND_DP = dict(data_parallel_replicate_degree=0, data_parallel_shard_degree=0, pipeline_parallel_degree=0,
                        pipeline_parallel_schedule="", pipeline_parallel_microbatch_size=0,
                        pipeline_parallel_stages_per_rank=0, module_fqns_per_model_part=None)


def _settings(cfg, *, parallelism: dict, ac: bool, loss: bool) -> tuple:
    """The config as a hashable key, batch sizes and the given parallelism fields neutral."""
    from trainer.config import SECTIONS

    out = []
    for name in SECTIONS:
        if name in _UNREAD_SECTIONS or (name == "activation_checkpoint" and not ac) or (name == "loss" and not loss):
            continue
        section = getattr(cfg, name)
        if name == "training":
            section = dataclasses.replace(section, **_BATCH)
        elif name == "parallelism":
            section = dataclasses.replace(section, **parallelism)
        out.append(repr(section))
    return (repr(cfg.model_args), *out)


def _placement(cfg) -> str:
    from parallelisms.parallel_dims import V_SCHEDULES

    return "V" if cfg.parallelism.pipeline_parallel_schedule in V_SCHEDULES else "loop"


def layout_key(cfg, world: int, device: str) -> tuple:
    """What the assembled parameters and FSDP units depend on (not AC, batch or the loss path)."""
    loss = dataclasses.replace(cfg.loss, chunked_ce=False)
    return (world, device, _placement(cfg), repr(loss),
            _settings(cfg, parallelism=dict(pipeline_parallel_microbatch_size=0, pipeline_parallel_schedule=""),
                      ac=False, loss=False))


def shard_key(cfg, layout: Layout, device: str) -> tuple:
    """What one module's parameters and FSDP units depend on: the sharding degrees, not pp
    (only whether PP is on), the schedule or the stage it sits in."""
    loss = dataclasses.replace(cfg.loss, chunked_ce=False)
    return (device, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.ep, layout.fsdp, layout.pp > 1,
            repr(loss), _settings(cfg, parallelism=_PIPELINE_AND_DP, ac=False, loss=False))


def _probe_context(cfg, layout: Layout, device: str, *, ac: bool) -> tuple:
    """What a block's (ac=True) or the head's probe depends on besides its input shape."""
    # dp_replicate and dp_shard stay in: under HSDP an EP block's backward keeps more (found by
    # comparing a whole 671B search against the full path), and a batch-scope balance loss
    # reduces over dp. The planner's references of one (tp, cp, ep) share dp_shard anyway.
    return (device, layout.dp_replicate, layout.dp_shard, layout.tp, layout.cp, layout.ep, layout.sequence_parallel,
            layout.loss_parallel, layout.fsdp, _settings(cfg, parallelism=_PIPELINE_AND_DP, ac=ac, loss=not ac))


def _layer_sig(module) -> tuple:
    return tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())


@dataclasses.dataclass
class _Split:
    """The pipeline split of one layout, from the meta model (no assembly)."""

    stage_fqns: list  # per stage: its model-level modules ("tok_embeddings", "layers.K", "norm", ...)
    stage_sigs: list  # per stage: its modules, blocks as their unsharded parameter signature
    stage_layers: list  # per stage: its block ids
    stage_has_embedding: list
    rank_stages: list  # per PP rank: its stage ids, in part order
    head_rank: int
    layer_sig: dict  # block id -> signature
    custom: bool  # the split is the user's (module_fqns_per_model_part): readings stay per stage

    def module_sig(self, fqn: str):
        return ("block", self.layer_sig[int(fqn.split(".")[1])]) if fqn.startswith("layers.") else fqn


def _relabel(p: RankParams, ids: dict) -> RankParams:
    """A stage's reading with its block ids renamed (a stage of the same shape elsewhere)."""
    def unit(k):
        return f"layers.{ids[int(k.split('.')[1])]}" if k.startswith("layers.") else k

    def name(k):  # a parameter of block K: renamed with its block
        return f"layers.{ids[int(k.split('.')[1])]}.{k.split('.', 2)[2]}" if k.startswith("layers.") else k

    return dataclasses.replace(p, unit_bytes={unit(k): v for k, v in p.unit_bytes.items()},
                               matrix_numel={ids[k]: v for k, v in p.matrix_numel.items()},
                               layer_param_bytes={ids[k]: v for k, v in p.layer_param_bytes.items()},
                               matrices={name(k): v for k, v in p.matrices.items()})


class EstimateCache:
    """Readings of assembled ranks, shared by the estimates that pass it (module doc)."""

    def __init__(self):
        self._splits: dict = {}  # (model, layout) -> _Split
        self._stages: dict = {}  # (layout key, stage signature) -> (RankParams of the stage, its block ids)
        self._modules: dict = {}  # (shard key, module signature) -> (its RankParams, its block id or None)
        self._additive: dict = {}  # shard key -> whether stages are the sum of their modules (no root params)
        self._precisions: dict = {}  # shard key -> (Precision, stream dtype)
        self._extra_groups: dict = {}  # (shard key, parts per rank) -> process groups the assembly adds to the mesh's
        self._layouts: dict = {}  # layout key -> NCCL communicators of rank 0
        self._blocks: dict = {}  # block key -> BlockProbe
        self._heads: dict = {}  # head key -> (this loss path, the other)
        self._embeddings: dict = {}  # (context, microbatch) -> bytes
        self.assemblies = 0  # ranks assembled so far (the cost)

    # ---- the split ----
    def _split(self, cfg, layout: Layout) -> _Split:
        from parallelisms.apply import build_model
        from parallelisms.pipeline import split_stages, stage_ids_for_rank

        par = cfg.parallelism
        spr = par.pipeline_parallel_stages_per_rank if layout.pp > 1 else 1
        key = (repr(cfg.model_args), layout.pp, spr, _placement(cfg), repr(par.module_fqns_per_model_part))
        if key not in self._splits:
            model = build_model(cfg.model_spec, cfg.model_args)
            sig = {int(k): _layer_sig(b) for k, b in model.layers.items()}
            if layout.pp == 1:
                from parallelisms.pipeline import model_units

                fqns = [sum(model_units(model), [])]
            elif par.module_fqns_per_model_part is not None:
                fqns = [list(s) for s in par.module_fqns_per_model_part]
            else:
                fqns = split_stages(model, layout.pp * spr)
            layers = [[int(f.split(".")[1]) for f in s if f.startswith("layers.")] for s in fqns]
            sigs = [tuple(sig[int(f.split(".")[1])] if f.startswith("layers.") else f for f in s) for s in fqns]
            ranks = [stage_ids_for_rank(r, layout.pp, spr, _placement(cfg) == "V") if layout.pp > 1 else [0]
                     for r in range(layout.pp)]
            head = next(r for r, ids in enumerate(ranks) if any("output" in fqns[s] for s in ids))
            self._splits[key] = _Split(fqns, sigs, layers, ["tok_embeddings" in s for s in fqns], ranks, head, sig,
                                       par.module_fqns_per_model_part is not None and layout.pp > 1)
        return self._splits[key]

    # ---- keys ----
    def _block_keys(self, split: _Split, cfg, layout: Layout, mb: int, device: str, factor: float) -> dict:
        """Rank 0's block id -> the key of its probe at receive factor `factor`."""
        from parallelisms.activation_checkpoint import block_mode

        ctx = _probe_context(cfg, layout, device, ac=True)
        seq, kinds = cfg.training.seq_len, {}
        for sid in split.rank_stages[0]:
            for i, lid in enumerate(split.stage_layers[sid]):
                rows = layout.token_seq(seq) if i == 0 and not split.stage_has_embedding[sid] \
                    else layout.residual_seq(seq)
                kinds[lid] = (split.layer_sig[lid], block_mode(cfg.activation_checkpoint, lid),
                              (mb, rows, cfg.model_args.dim))
        history = tuple(kinds.values()) if cfg.activation_checkpoint.mode == "budget" else ()
        out = {}
        for lid, kind in kinds.items():
            expert = any(is_expert(n) for n, *_ in kind[0])
            out[lid] = (ctx, kind, factor if expert else 1.0, history)  # routing only moves experts' rows
        return out

    def _head_key(self, cfg, layout: Layout, mb: int, device: str) -> tuple:
        return (_probe_context(cfg, layout, device, ac=False), mb, cfg.loss.chunked_ce, chunked_ce_allowed(cfg))

    def _embedding_key(self, cfg, layout: Layout, mb: int, device: str) -> tuple:
        return (_probe_context(cfg, layout, device, ac=False), mb)

    # ---- reading ----
    def read(self, items: list, world: int, device: str) -> list[RankFacts]:
        """`RankFacts` of each (cfg, layout, microbatch, EP receive factor or None) in `items`,
        which share the layout and the AC settings (they may differ in batch sizes and in
        whether the EP-skewed probe is asked); assembles only what is not known."""
        cfg0, layout0, *_ = items[0]
        lkey, skey = layout_key(cfg0, world, device), shard_key(cfg0, layout0, device)
        ac0 = repr(cfg0.activation_checkpoint)
        if any(layout_key(c, world, device) != lkey or repr(c.activation_checkpoint) != ac0 for c, *_ in items):
            raise ValueError("EstimateCache.read: items must share the layout and the AC settings")
        split = self._split(cfg0, layout0)
        gkey = (skey, len(split.rank_stages[0]))
        jobs = [(cfg, layout, mb, f) for cfg, layout, mb, skew in items
                for f in (1.0,) + ((skew,) if skew is not None else ())]

        def block_missing(job):
            cfg, layout, mb, f = job
            keys = self._block_keys(split, cfg, layout, mb, device, f)
            return any(k not in self._blocks for k in keys.values()) or \
                (f == 1.0 and self._embedding_key(cfg, layout, mb, device) not in self._embeddings)

        def heads_missing(r: int) -> bool:
            return r == split.head_rank and any(self._head_key(c, l, mb, device) not in self._heads
                                                for c, l, mb, _ in items)

        def unread(r: int) -> bool:
            return any(self._stage_reading(lkey, skey, split, s) is None for s in split.rank_stages[r])

        # budget calibrates and op records its recompute plan on a block's first call, so each of
        # their probes gets a fresh assembly, as the full path's (the EP-skewed probe included).
        calibrating = cfg0.activation_checkpoint.mode in ("budget", "op")
        pending = [j for j in jobs if block_missing(j)]
        mesh_groups = self._mesh_groups(cfg0, world, device) if lkey not in self._layouts else None
        first = True
        # Rank 0: the blocks and the embedding, its stages if new, the head if there, and what
        # assembling adds to the mesh's process groups (once per sharding).
        while pending or (first and (unread(0) or heads_missing(0) or gkey not in self._extra_groups)):
            with self._assemble(cfg0, world, 0, device, fake=bool(pending) or (first and heads_missing(0))) as rank:
                if first:
                    self._read_stages(rank, lkey, skey, split, 0)
                    if gkey not in self._extra_groups:
                        self._extra_groups[gkey] = nccl_communicators() - mesh_groups
                        self._precisions[skey] = (rank.precision, rank.stream_dtype)
                pristine = True
                for job in list(pending):
                    if calibrating and not pristine:
                        continue  # a calibrating policy gets a fresh assembly per probe
                    self._probe(rank, split, job, device)
                    pending.remove(job)
                    pristine = False
                if first and heads_missing(0):
                    self._probe_heads(rank, items, device)
            first = False
        # The head's rank, then every rank holding a stage (or module) not read yet.
        for r in [split.head_rank] + list(range(1, layout0.pp)):
            if r and (unread(r) or heads_missing(r)):
                with self._assemble(cfg0, world, r, device, fake=heads_missing(r)) as rank:
                    self._read_stages(rank, lkey, skey, split, r)
                    if heads_missing(r):
                        self._probe_heads(rank, items, device)
        if lkey not in self._layouts:
            self._layouts[lkey] = mesh_groups + self._extra_groups[gkey]
        return [self._facts(split, lkey, skey, cfg, layout, mb, device, skew) for cfg, layout, mb, skew in items]

    def _assemble(self, cfg, world: int, pp_rank: int, device: str, fake: bool):
        """Assembles a rank; on fake tensors only where something is probed on it."""
        self.assemblies += 1
        return assemble_rank(cfg, world, pp_rank=pp_rank, device=device, fake=fake)

    @staticmethod
    def _mesh_groups(cfg, world: int, device: str) -> int:
        """Rank 0's communicators of the device mesh alone (no model: milliseconds)."""
        from parallelisms.parallel_dims import ParallelDims

        dims = ParallelDims.from_config(assembly_config(cfg, device).parallelism, world)
        with fake_world(world, 0):
            dims.build_mesh("cpu")
            return nccl_communicators()

    def _read_stages(self, rank, lkey: tuple, skey: tuple, split: _Split, r: int) -> None:
        """Keeps each part's reading as its stage's, and, where a stage is the sum of its
        modules (FSDP's root unit holds nothing), each module's for stages of any split."""
        empty = RankParams(0, {}, 0, {})
        for part, sid in zip(rank.parts, split.rank_stages[r]):
            modules = read_modules(part)  # read_params([part]) is their sum
            self._stages.setdefault((lkey, split.stage_sigs[sid]),
                                    (merge_params(list(modules.values())), split.stage_layers[sid]))
            root = modules.get("", empty)
            additive = not split.custom and root.param_bytes == 0 and not any(root.unit_bytes.values()) and \
                set(modules) <= set(split.stage_fqns[sid]) | {""}
            self._additive[skey] = self._additive.get(skey, True) and additive
            if not additive:
                continue
            self._modules[(skey, "")] = (root, None)
            for fqn in split.stage_fqns[sid]:
                lid = int(fqn.split(".")[1]) if fqn.startswith("layers.") else None
                self._modules.setdefault((skey, split.module_sig(fqn)), (modules.get(fqn, empty), lid))

    def _stage_reading(self, lkey: tuple, skey: tuple, split: _Split, sid: int) -> RankParams | None:
        """Stage `sid`'s reading: its own, or the sum of its modules' read in other stages."""
        ids = split.stage_layers[sid]
        if (lkey, split.stage_sigs[sid]) in self._stages:
            params, own = self._stages[(lkey, split.stage_sigs[sid])]
            return _relabel(params, dict(zip(own, ids)))
        if not self._additive.get(skey, False):
            return None
        readings = []
        for fqn in [*split.stage_fqns[sid], ""]:
            hit = self._modules.get((skey, split.module_sig(fqn) if fqn else ""))
            if hit is None:
                return None
            reading, lid = hit
            readings.append(_relabel(reading, {lid: int(fqn.split(".")[1])} if lid is not None else {}))
        return merge_params(readings)

    def _probe_heads(self, rank, items: list, device: str) -> None:
        for cfg, layout, mb, _ in items:
            key = self._head_key(cfg, layout, mb, device)
            if key not in self._heads:
                self._heads[key] = probe_heads(rank, cfg, layout, mb)

    def _probe(self, rank, split: _Split, job, device: str) -> None:
        cfg, layout, mb, factor = job
        keys = self._block_keys(split, cfg, layout, mb, device, factor)
        first_of: dict = {}  # one block per missing key (FSDP's lazy init can make equal blocks look unequal)
        for lid, key in keys.items():
            if key not in self._blocks:
                first_of.setdefault(key, lid)
        # A policy that learns on a block's first call needs the warm-up call: budget calibrates,
        # and op records its recompute plan (parallelisms/ac_dce.py); for none and full the first
        # call equals the second.
        readout = probe_blocks(rank, cfg, layout, mb, factor, want=set(first_of.values()).__contains__,
                               warm=cfg.activation_checkpoint.mode in ("budget", "op"))
        for key, lid in first_of.items():
            self._blocks[key] = readout.probes[readout.kind_of[lid]]
        if factor == 1.0:
            self._embeddings[self._embedding_key(cfg, layout, mb, device)] = readout.embedding_saved

    def _facts(self, split: _Split, lkey: tuple, skey: tuple, cfg, layout: Layout, mb: int, device: str,
               skew: float | None) -> RankFacts:
        per_rank = [merge_params([self._stage_reading(lkey, skey, split, sid) for sid in stage_ids])
                    for stage_ids in split.rank_stages]
        communicators = self._layouts[lkey]
        precision, dtype = self._precisions[skey]
        stage_layers = [list(split.stage_layers[s]) for s in split.rank_stages[0]]

        def readout(factor: float) -> BlockReadout:
            probes, kind_of, label_of = {}, {}, {}
            for lid, key in self._block_keys(split, cfg, layout, mb, device, factor).items():
                kind = key[1]
                kind_of[lid] = kind
                if kind not in probes:
                    probes[kind] = self._blocks[key]
                    label_of[kind] = f"{kind[1]}/{'moe' if any(is_expert(n) for n, *_ in kind[0]) else 'dense'}"
            emb = self._embeddings[self._embedding_key(cfg, layout, mb, device)]
            return BlockReadout(probes, kind_of, label_of, emb)

        heads = self._heads[self._head_key(cfg, layout, mb, device)]
        return RankFacts(per_rank, communicators, precision, stage_layers, dtype, readout(1.0), heads,
                         readout(skew) if skew is not None else None)
