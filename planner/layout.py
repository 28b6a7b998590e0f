"""One candidate plan: the layout and the options a run is configured with.

A `Plan` is exactly what the trainer reads: `overrides()` gives the `--section.key value`
arguments that `./run_train.sh` takes, so a printed plan, its `--write` TOML and the
validators' verdict all come from the same values.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    world: int
    dp_replicate: int
    dp_shard: int
    tp: int = 1
    cp: int = 1
    cp_method: str = "allgather"
    pp: int = 1
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    microbatch: int = 1  # samples per PP microbatch
    ep: int = 1
    local_batch: int = 1  # samples per microbatch on a data-parallel rank
    grad_accum: int = 1
    ac: str = "none"  # none | full | op | budget
    budget_fraction: float = 0.5
    chunked_ce: bool = False
    float8: bool = False
    float8_all_gather: bool = False  # FSDP gathers the float8 linears' weights in float8 (tensorwise)
    compile: bool = False

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.dp * self.grad_accum

    @property
    def samples_per_microbatch(self) -> int:
        return self.microbatch if self.pp > 1 else self.local_batch

    @property
    def n_microbatches(self) -> int:
        """Microbatches one step runs through a rank (PP microbatches x accumulation)."""
        per = self.local_batch // self.microbatch if self.pp > 1 else 1
        return per * self.grad_accum

    def ac_label(self) -> str:
        return f"budget {self.budget_fraction:g}" if self.ac == "budget" else self.ac

    def layout_label(self) -> str:
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"rep{self.dp_replicate}")
        if self.dp_shard > 1:
            parts.append(f"fsdp{self.dp_shard}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}{'a2a' if self.cp_method == 'alltoall' else 'ag'}")
        if self.pp > 1:
            short = {"Interleaved1F1B": "I1F1B", "InterleavedZeroBubble": "IZB", "ZBVZeroBubble": "ZBV"}
            parts.append(f"pp{self.pp}:{short.get(self.schedule, self.schedule)}"
                         + (f"x{self.stages_per_rank}" if self.stages_per_rank > 1 else "") + f"/mb{self.microbatch}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return "x".join(parts) or "1 rank"

    def options_label(self) -> str:
        opts = [f"lbs{self.local_batch}"] + ([f"ga{self.grad_accum}"] if self.grad_accum > 1 else [])
        opts += [n for n, on in (("cce", self.chunked_ce), ("fp8", self.float8 and not self.float8_all_gather),
                                 ("fp8ag", self.float8 and self.float8_all_gather), ("compile", self.compile)) if on]
        return " ".join(opts)

    def overrides(self) -> list[str]:
        """The trainer arguments of this plan (`./run_train.sh ... <these>`)."""
        a = ["--parallelism.data_parallel_replicate_degree", str(self.dp_replicate),
             "--parallelism.data_parallel_shard_degree", str(self.dp_shard),
             "--parallelism.tensor_parallel_degree", str(self.tp),
             "--parallelism.context_parallel_degree", str(self.cp),
             "--parallelism.context_parallel_method", self.cp_method,
             "--parallelism.pipeline_parallel_degree", str(self.pp),
             "--parallelism.pipeline_parallel_schedule", self.schedule,
             "--parallelism.pipeline_parallel_stages_per_rank", str(self.stages_per_rank),
             "--parallelism.pipeline_parallel_microbatch_size", str(self.microbatch),
             "--parallelism.expert_parallel_degree", str(self.ep),
             "--training.local_batch_size", str(self.local_batch),
             "--training.global_batch_size", str(self.global_batch),
             "--activation_checkpoint.mode", self.ac,
             "--loss.chunked_ce", str(self.chunked_ce).lower(),
             "--float8.enable", str(self.float8).lower(),
             "--compile.enable", str(self.compile).lower()]
        if self.float8:  # the trainer refuses the field with float8 off
            a += ["--float8.enable_fsdp_float8_all_gather", str(self.float8_all_gather).lower()]
        if self.ac == "budget":
            a += ["--activation_checkpoint.budget_fraction", str(self.budget_fraction)]
        return a


def plan_of_config(cfg, world: int) -> Plan:
    """The plan a loaded config runs on `world` ranks (its own layout, for --dry-run)."""
    from parallelisms.parallel_dims import ParallelDims
    from trainer.layout import batch_layout

    p, t = cfg.parallelism, cfg.training
    dims = ParallelDims.from_config(p, world)
    accum, _ = batch_layout(t, dims.dp_degree)
    pp = dims.pp
    return Plan(world=world, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp, cp=dims.cp,
                cp_method=p.context_parallel_method, pp=pp, schedule=p.pipeline_parallel_schedule,
                stages_per_rank=p.pipeline_parallel_stages_per_rank,
                microbatch=p.pipeline_parallel_microbatch_size, ep=dims.ep,
                local_batch=t.local_batch_size, grad_accum=accum, ac=cfg.activation_checkpoint.mode,
                budget_fraction=cfg.activation_checkpoint.budget_fraction, chunked_ce=cfg.loss.chunked_ce,
                float8=cfg.float8.enable, compile=cfg.compile.enable,
                float8_all_gather=cfg.float8.enable and cfg.float8.enable_fsdp_float8_all_gather)


_SCHEDULES = {"I1F1B": "Interleaved1F1B", "IZB": "InterleavedZeroBubble", "ZBV": "ZBVZeroBubble"}


def legend(plans) -> str:
    """What each part of the labels in `plans` means (`layout_label`, `options_label`), one
    line per part that occurs, e.g. `fsdp2xcp2agxpp2:ZBVx2/mb1` and `lbs4 ga2 fp8ag compile`."""
    import re

    seen: dict[str, str] = {"x": "a layout's parts are joined by x; their degrees multiply to the GPU count "
                                 "(ep's ranks are borrowed from fsdp x cp x tp)"}
    for p in plans:
        if p.dp_replicate > 1:
            seen.setdefault("rep", "repN: HSDP, N replicas of the sharded model (gradients all-reduced "
                                   "between them)")
        if p.dp_shard > 1:
            seen.setdefault("fsdp", "fsdpN: FSDP, parameters, gradients and optimizer states sharded over N ranks")
        if p.tp > 1:
            seen.setdefault("tp", "tpN: tensor parallel (with sequence parallel) over N ranks of a node")
        if p.cp > 1:
            key = "cpag" if p.cp_method == "allgather" else "cpa2a"
            seen.setdefault(key, "cpNag: context parallel over N ranks, K/V all-gathered" if key == "cpag" else
                            "cpNa2a: context parallel over N ranks, Ulysses all-to-all of q, k, v and the output")
        if p.pp > 1:
            label = p.layout_label()
            m = re.search(r"pp\d+:[^x/]+(x\d+)?/mb\d+", label)
            seen.setdefault("pp", "ppN:S[xV]/mbM: pipeline over N ranks, schedule S, V stages per rank (1 if "
                                  f"absent), M samples per microbatch, e.g. {m.group(0) if m else label}")
            short = next((k for k, v in _SCHEDULES.items() if v == p.schedule), None)
            if short:
                seen.setdefault(short, f"{short}: {p.schedule}")
        if p.ep > 1:
            seen.setdefault("ep", "epN: expert parallel, routed experts split over N ranks (borrowed from fsdp x cp "
                                  "x tp)")
        seen.setdefault("lbs", "lbsN: samples per data-parallel rank per forward and backward (the local batch; PP "
                               "splits it into microbatches)")
        if p.grad_accum > 1:
            seen.setdefault("ga", "gaN: gradient accumulation over N local batches")
        if p.chunked_ce:
            seen.setdefault("cce", "cce: chunked cross-entropy (the logits never whole)")
        if p.float8:
            seen.setdefault("fp8ag" if p.float8_all_gather else "fp8",
                            "fp8ag: float8 linears, FSDP all-gathers their weights in float8" if p.float8_all_gather
                            else "fp8: float8 linears (bf16 all-gather)")
        if p.compile:
            seen.setdefault("compile", "compile: torch.compile of each block")
    order = ["x", "rep", "fsdp", "tp", "cpag", "cpa2a", "pp", *_SCHEDULES, "ep", "lbs", "ga", "cce", "fp8", "fp8ag",
             "compile"]
    return "\n".join(["legend:"] + [f"  {seen[k]}" for k in order if k in seen])
