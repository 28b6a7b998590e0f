"""A cache that lets many estimates share assemblies and probes (the planner's fast path).

Why: assembling one rank of a large model on fake tensors is what an estimate costs
(0.6-2 s per PP rank of DeepSeek V3 671B on a quiet 2-core CPU, every PP rank once), and
a layout search asks for hundreds of estimates that differ in a few settings. What each
reading depends on is narrower than the whole config, so each is kept under that key:

- a PP rank's parameters and FSDP units depend on the layout and the model, not on AC,
  batch sizes or the loss. Two pipeline stages that hold the same kinds of blocks (equal
  unsharded parameter shapes) in the same order, and the same other modules (embedding,
  norm + output), hold the same bytes: per layout, one rank is assembled for each stage
  shape not seen yet (rank 0, the head's rank, the odd middle one), and every other
  rank's counts are read off those stages;
- a block's probe depends on its kind, AC mode, input shape and the plans that change the
  block (tp, cp, ep, sequence parallel, FSDP's compute dtype), not on pp, dp_shard, HSDP or
  the schedule; the head's and the embedding's probes likewise, without AC;
- one assembly of rank 0 serves every batch size asked for together and the EP-skewed
  probe, except under AC mode `budget`, whose policy calibrates each block kind on its
  first call: there each probe gets a fresh assembly, and a block's probe is kept only with
  all of rank 0's kinds in order (the calibration history), as the reference path runs it.

The estimate is then computed from these readings by the same code as the reference path
(`trainer.memory.rank_facts.read_every_rank`); tests/test_memory_cache.py checks both give
equal bytes.
"""

from __future__ import annotations

import dataclasses

from trainer.memory.assemble import Layout, assemble_rank, chunked_ce_allowed
from trainer.memory.device_overhead import nccl_communicators
from trainer.memory.probes import is_expert
from trainer.memory.rank_facts import BlockReadout, RankFacts, RankParams, probe_blocks, probe_heads, read_params

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


def _probe_context(cfg, layout: Layout, device: str, *, ac: bool) -> tuple:
    """What a block's (ac=True) or the head's probe depends on besides its input shape."""
    return (device, layout.tp, layout.cp, layout.ep, layout.sequence_parallel, layout.loss_parallel, layout.fsdp,
            _settings(cfg, parallelism=_PIPELINE_AND_DP, ac=ac, loss=not ac))


def _layer_sig(module) -> tuple:
    return tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())


@dataclasses.dataclass
class _Split:
    """The pipeline split of one layout, from the meta model (no assembly)."""

    stage_sigs: list  # per stage: its modules, blocks as their unsharded parameter signature
    stage_layers: list  # per stage: its block ids
    stage_has_embedding: list
    rank_stages: list  # per PP rank: its stage ids, in part order
    head_rank: int
    layer_sig: dict  # block id -> signature


def _merge(parts: list[RankParams]) -> RankParams:
    """One rank's `RankParams` from its parts' (what `read_params` sums over the parts)."""
    units: dict = {}
    matrix: dict = {}
    for p in parts:
        for k, v in p.unit_bytes.items():
            units[k] = units.get(k, 0) + v
        for k, v in p.matrix_numel.items():
            matrix[k] = matrix.get(k, 0) + v
    return RankParams(sum(p.param_bytes for p in parts), units, sum(p.head_param_bytes for p in parts), matrix)


def _relabel(p: RankParams, ids: dict) -> RankParams:
    """A stage's reading with its block ids renamed (a stage of the same shape elsewhere)."""
    def unit(k):
        return f"layers.{ids[int(k.split('.')[1])]}" if k.startswith("layers.") else k

    return RankParams(p.param_bytes, {unit(k): v for k, v in p.unit_bytes.items()}, p.head_param_bytes,
                      {ids[k]: v for k, v in p.matrix_numel.items()})


class EstimateCache:
    """Readings of assembled ranks, shared by the estimates that pass it (module doc)."""

    def __init__(self):
        self._splits: dict = {}  # (model, layout) -> _Split
        self._stages: dict = {}  # (layout key, stage signature) -> (RankParams of the stage, its block ids)
        self._layouts: dict = {}  # layout key -> (communicators, precision, stream dtype)
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
            self._splits[key] = _Split(sigs, layers, ["tok_embeddings" in s for s in fqns], ranks, head, sig)
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
    def read(self, items: list, world: int, device: str, skew: float | None) -> list[RankFacts]:
        """`RankFacts` of each (cfg, layout, microbatch) in `items`, which share the layout and
        the AC settings (they may differ in batch sizes); assembles only what is not known."""
        cfg0, layout0, _ = items[0]
        lkey = layout_key(cfg0, world, device)
        ac0 = repr(cfg0.activation_checkpoint)
        if any(layout_key(c, world, device) != lkey or repr(c.activation_checkpoint) != ac0 for c, *_ in items):
            raise ValueError("EstimateCache.read: items must share the layout and the AC settings")
        split = self._split(cfg0, layout0)
        factors = (1.0,) + ((skew,) if skew is not None else ())
        jobs = [(cfg, layout, mb, f) for cfg, layout, mb in items for f in factors]
        head_jobs = [(cfg, layout, mb) for cfg, layout, mb in items]

        def block_missing(job):
            cfg, layout, mb, f = job
            keys = self._block_keys(split, cfg, layout, mb, device, f)
            return [lid for lid, k in keys.items() if k not in self._blocks] or \
                (f == 1.0 and self._embedding_key(cfg, layout, mb, device) not in self._embeddings)

        def head_missing(job):
            return self._head_key(job[0], job[1], job[2], device) not in self._heads

        calibrating = cfg0.activation_checkpoint.mode == "budget"
        pending = [j for j in jobs if block_missing(j)]
        new_layout = lkey not in self._layouts
        heads_here = split.head_rank == 0 and any(map(head_missing, head_jobs))
        first = True
        # Rank 0: its stages' parameters (a new layout), the blocks and embedding, the head if there.
        while pending or (first and (new_layout or heads_here)):
            with self._assemble(cfg0, world, 0, device) as rank:
                if first and new_layout:
                    self._read_stages(rank, lkey, split, 0)
                    self._layouts[lkey] = (nccl_communicators(), rank.precision, rank.stream_dtype)
                pristine = True
                for job in list(pending):
                    if calibrating and not pristine:
                        continue  # a calibrating policy gets a fresh assembly per probe
                    self._probe(rank, split, job, device)
                    pending.remove(job)
                    pristine = False
                if first and heads_here:
                    self._probe_heads(rank, head_jobs, device)
            first = False
        # The head's rank, then every rank holding a stage shape not read yet.
        for r in [split.head_rank] + list(range(1, layout0.pp)):
            stage_unseen = any((lkey, split.stage_sigs[s]) not in self._stages for s in split.rank_stages[r])
            heads = r == split.head_rank and r != 0 and any(map(head_missing, head_jobs))
            if stage_unseen or heads:
                with self._assemble(cfg0, world, r, device) as rank:
                    self._read_stages(rank, lkey, split, r)
                    if heads:
                        self._probe_heads(rank, head_jobs, device)
        return [self._facts(split, lkey, cfg, layout, mb, device, skew) for cfg, layout, mb in items]

    def _assemble(self, cfg, world: int, pp_rank: int, device: str):
        self.assemblies += 1
        return assemble_rank(cfg, world, pp_rank=pp_rank, device=device)

    def _read_stages(self, rank, lkey: tuple, split: _Split, r: int) -> None:
        for part, sid in zip(rank.parts, split.rank_stages[r]):
            key = (lkey, split.stage_sigs[sid])
            if key not in self._stages:
                self._stages[key] = (read_params([part]), split.stage_layers[sid])

    def _probe_heads(self, rank, head_jobs: list, device: str) -> None:
        for cfg, layout, mb in head_jobs:
            key = self._head_key(cfg, layout, mb, device)
            if key not in self._heads:
                self._heads[key] = probe_heads(rank, cfg, layout, mb)

    def _probe(self, rank, split: _Split, job, device: str) -> None:
        cfg, layout, mb, factor = job
        keys = self._block_keys(split, cfg, layout, mb, device, factor)
        missing = {lid for lid, k in keys.items() if k not in self._blocks}
        readout = probe_blocks(rank, cfg, layout, mb, factor, want=missing.__contains__)
        for lid in missing:
            self._blocks[keys[lid]] = readout.probes[readout.kind_of[lid]]
        if factor == 1.0:
            self._embeddings[self._embedding_key(cfg, layout, mb, device)] = readout.embedding_saved

    def _facts(self, split: _Split, lkey: tuple, cfg, layout: Layout, mb: int, device: str,
               skew: float | None) -> RankFacts:
        per_rank = []
        for r, stage_ids in enumerate(split.rank_stages):
            parts = []
            for sid in stage_ids:
                params, ids = self._stages[(lkey, split.stage_sigs[sid])]
                parts.append(_relabel(params, dict(zip(ids, split.stage_layers[sid]))))
            per_rank.append(_merge(parts))
        communicators, precision, dtype = self._layouts[lkey]
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
