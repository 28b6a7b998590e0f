"""Parallel degrees -> one world device mesh with named sub-meshes."""

from __future__ import annotations

from dataclasses import dataclass

from configuration.fields import opt

PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass
class ParallelismConfig:
    """[parallelism]: how the world is split. Degrees multiply to the world size."""

    data_parallel_replicate_degree: int = opt(1, "HSDP replicas (DDP-style replication of FSDP groups).", min=1)
    data_parallel_shard_degree: int = opt(-1, "FSDP shard degree; -1 means whatever the other degrees leave.", min=-1)
    tensor_parallel_degree: int = opt(1, "Tensor parallel degree (must divide heads and KV heads).", min=1)
    pipeline_parallel_degree: int = opt(1, "Pipeline parallel degree (stages over ranks).", min=1)
    context_parallel_degree: int = opt(1, "Context parallel degree: ranks that split each sequence (load-balanced "
                                       "causal chunks); seq_len must be a multiple of 2 x this.", min=1)
    context_parallel_method: str = opt("allgather", "How CP attention sees the other ranks' tokens: allgather (K/V "
                                       "gathered) or alltoall (Ulysses: heads split over CP; cp must divide them).",
                                       choices=("allgather", "alltoall"))
    expert_parallel_degree: int = opt(1, "Expert parallel degree for MoE models; ranks are borrowed from dp_shard x "
                                      "cp x tp.", min=1)
    enable_sequence_parallel: bool = opt(True, "With TP, shard norms and residuals over the sequence.")
    disable_loss_parallel: bool = opt(False, "With TP, gather logits instead of computing the loss on vocab shards.")
    fsdp_reshard_after_forward: str = opt(
        "default", "Free gathered params after forward: default (yes, except the last module / PP), always, never.",
        choices=("default", "always", "never"))
    fsdp_cpu_offload: bool = opt(False, "Keep sharded params, grads and optimizer state on CPU (FSDP2 CPUOffloadPolicy).")
    pipeline_parallel_schedule: str = opt("1F1B", "Pipeline schedule by name.", choices=PP_SCHEDULES)
    pipeline_parallel_microbatch_size: int = opt(1, "Samples per pipeline microbatch; local_batch_size must be a multiple.", min=1)
    pipeline_parallel_stages_per_rank: int = opt(1, "Model stages per PP rank (>1 for interleaved and V schedules).", min=1)
    module_fqns_per_model_part: list[list[str]] | None = opt(
        None, "Override of the PP split: module names per stage, e.g. [[\"tok_embeddings\", \"layers.0\"], ...].")

    def validate(self, root) -> None:
        """Layout checks that need no world size (they also run for --dry-run); the world-size
        checks run when `ParallelDims` is built. `root.model_args` is resolved once, before."""
        from parallelisms.float8 import float8_filter

        check_layout(self, root.model_args, seq_len=root.training.seq_len,
                     local_batch_size=root.training.local_batch_size, model_spec=root.model_spec,
                     chunked_ce=root.loss.chunked_ce,
                     float8_filter=float8_filter(root.float8))


def check_layout(cfg: ParallelismConfig, model_args, *, seq_len: int, local_batch_size: int,
                 model_spec=None, chunked_ce: bool = False, float8_filter: list[str] | None = None) -> None:
    """Every check of the degrees against the model, the loss and the batch (no world size):
    the one place that validates `tensor_parallel_degree` and the other degrees.
    `float8_filter`: float8.filter_fqns when float8 is on, else None."""
    from configuration.fields import ConfigError

    tp, pp = cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree
    if tp > 1 and model_spec is not None and model_spec.tensor_parallel_fn is None:
        raise ConfigError(f"config error: parallelism.tensor_parallel_degree: {model_spec.name} has no TP plan; "
                          "set it to 1")
    # Chunked CE computes the loss inside the output head's module: it needs the whole vocab
    # (no TP) and the head on the rank that holds the labels (no PP).
    for degree, field_name in ((tp, "tensor_parallel_degree"), (pp, "pipeline_parallel_degree")):
        if chunked_ce and degree > 1:
            raise ConfigError(f"config error: loss.chunked_ce: not supported with parallelism.{field_name} > 1 "
                              f"(got {degree}); set --loss.chunked_ce false or {field_name} 1")
    check_model_layout(model_args, tp=tp, pp=pp, seq_len=seq_len,
                       sequence_parallel=cfg.enable_sequence_parallel and tp > 1)
    if pp > 1:
        if getattr(model_args, "tie_embeddings", False):
            # The first and the last stage would each hold a copy of the one tied matrix.
            raise ConfigError(f"config error: parallelism.pipeline_parallel_degree: {pp}, but this model ties its "
                              "output head to the embedding (tie_embeddings), which pipeline stages cannot share; "
                              "set it to 1 or use an untied flavor")
        if getattr(model_args, "aux_loss_scope", None) == "model" and getattr(model_args, "aux_loss_coeff", 0) > 0 \
                and getattr(model_args, "n_routed_experts", 0):
            # One balance loss over every MoE layer of a forward (models/common/moe_pool.py).
            raise ConfigError("config error: moe.aux_loss_scope: 'model' pools the routing of every MoE layer into "
                              "one balance loss (HF's), which pipeline stages cannot share; under "
                              f"pipeline_parallel_degree {pp} use --moe.aux_loss_scope batch (one loss per layer) or "
                              "--moe.aux_loss_coeff 0")
        check_pipeline_layout(cfg, getattr(model_args, "n_layers", None), local_batch_size)
    if cfg.context_parallel_degree > 1:
        from parallelisms.context_parallel import check_context_parallel_layout

        check_context_parallel_layout(model_args, cp=cfg.context_parallel_degree, tp=tp,
                                      method=cfg.context_parallel_method, seq_len=seq_len,
                                      sequence_parallel=cfg.enable_sequence_parallel, float8_filter=float8_filter)
    if cfg.expert_parallel_degree > 1:
        from parallelisms.expert_parallel import check_expert_parallel_layout

        check_expert_parallel_layout(model_args, ep=cfg.expert_parallel_degree, tp=tp,
                                     sequence_parallel=cfg.enable_sequence_parallel)
        if model_spec is not None and model_spec.expert_parallel_fn is None:
            raise ConfigError(f"config error: parallelism.expert_parallel_degree: {model_spec.name} has no EP plan; "
                              "set it to 1")


# Schedules that run one stage per rank, and those that need exactly two (a "V").
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def check_model_layout(model_args, *, tp: int, pp: int, seq_len: int, sequence_parallel: bool) -> None:
    """TP must divide heads and KV heads; SP needs seq_len divisible by TP; at most one stage per layer."""
    from configuration.fields import ConfigError

    n_heads = getattr(model_args, "n_heads", None)
    n_kv = getattr(model_args, "n_kv_heads", None) or n_heads
    if tp > 1 and n_heads is not None:
        for name, count in (("heads", n_heads), ("KV heads", n_kv)):
            if count % tp != 0:
                raise ConfigError(
                    f"config error: parallelism.tensor_parallel_degree: {tp} does not divide the model's "
                    f"{count} {name}; use a TP degree that divides {count}")
    if tp > 1 and sequence_parallel and seq_len % tp != 0:
        raise ConfigError(
            f"config error: training.seq_len: {seq_len} is not divisible by tensor_parallel_degree "
            f"{tp} with sequence parallel on; use a multiple of {tp} or "
            "--parallelism.enable_sequence_parallel false")
    n_layers = getattr(model_args, "n_layers", None)
    if pp > 1 and n_layers is not None and pp > n_layers:
        raise ConfigError(
            f"config error: parallelism.pipeline_parallel_degree: {pp} stages exceed the model's "
            f"{n_layers} layers; use at most {n_layers}")


def check_pipeline_layout(cfg: ParallelismConfig, n_layers: int | None, local_batch_size: int) -> None:
    """Stages per rank vs schedule, stages vs layers, microbatches vs schedule."""
    from configuration.fields import ConfigError

    pp, spr, name = cfg.pipeline_parallel_degree, cfg.pipeline_parallel_stages_per_rank, cfg.pipeline_parallel_schedule
    stages = pp * spr
    if name in SINGLE_STAGE_SCHEDULES and spr != 1:
        raise ConfigError(
            f"config error: parallelism.pipeline_parallel_stages_per_rank: {name} runs one stage per rank, got "
            f"{spr}; set it to 1 or use Interleaved1F1B / LoopedBFS / InterleavedZeroBubble")
    if name in V_SCHEDULES and spr != 2:
        raise ConfigError(
            f"config error: parallelism.pipeline_parallel_stages_per_rank: {name} needs exactly 2 stages per rank "
            f"(a V: the first and last stage on PP rank 0), got {spr}; set it to 2")
    override = cfg.module_fqns_per_model_part
    if override is not None:
        if len(override) != stages:
            raise ConfigError(
                f"config error: parallelism.module_fqns_per_model_part: {len(override)} stages listed, but "
                f"pipeline_parallel_degree({pp}) x pipeline_parallel_stages_per_rank({spr}) = {stages}; list "
                f"{stages} stages")
    elif n_layers is not None and stages > n_layers:
        raise ConfigError(
            f"config error: parallelism.pipeline_parallel_stages_per_rank: pipeline_parallel_degree({pp}) x "
            f"stages_per_rank({spr}) = {stages} stages exceed the model's {n_layers} layers; use at most "
            f"{n_layers} stages")
    mb = cfg.pipeline_parallel_microbatch_size
    if local_batch_size % mb != 0:
        raise ConfigError(
            f"config error: training.local_batch_size: {local_batch_size} is not a multiple of "
            f"pipeline_parallel_microbatch_size {mb}; use a multiple of {mb}")
    n_mb = local_batch_size // mb
    need = {"1F1B": pp, "Interleaved1F1B": pp, "InterleavedZeroBubble": pp, "ZBVZeroBubble": pp,
            "DualPipeV": stages}.get(name, 1)
    if n_mb < need:
        raise ConfigError(
            f"config error: parallelism.pipeline_parallel_microbatch_size: local_batch_size({local_batch_size}) / "
            f"microbatch_size({mb}) = {n_mb} microbatches, but {name} with {stages} stages on {pp} ranks needs at "
            f"least {need}; raise training.local_batch_size to {need * mb} or lower the microbatch size")
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_mb // pp)
        if n_mb % rounds != 0:
            raise ConfigError(
                f"config error: parallelism.pipeline_parallel_microbatch_size: {name} needs the microbatch count "
                f"({n_mb}) to be a multiple of microbatches // pp_degree = {rounds}; use a multiple of {pp} "
                "microbatches")


# Mesh dimension order, outermost first. PP is outermost so that stages talk
# across nodes rarely; TP is innermost so that it stays inside a node.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class ParallelDims:
    """Resolved degrees plus the world mesh built from them.

    Only dimensions with degree > 1 become mesh dimensions, so a degree of 1
    creates no process group. Flattened views:
      - "dp":      dp_replicate x dp_shard, over which data is sharded;
      - "fsdp":    dp_shard x cp, over which dense params are sharded (HSDP adds dp_replicate);
      - "dp_cp":   dp_replicate x dp_shard x cp, over which gradients/losses are reduced;
      - "dp_cp_tp": every rank of one pipeline stage (MoE loads are summed over it: under
                   sequence parallel, TP ranks route different tokens).
    Expert meshes (ep > 1, see parallelisms/expert_parallel.py): the dp_shard x cp x tp
    ranks, tp innermost, are unflattened into ("efsdp", "ep"), ep innermost; so EP borrows
    TP ranks first, then CP, then dp_shard ranks (CP ranks route different tokens, as data
    ranks do). Routed experts are split over "ep" and FSDP-sharded
    over "efsdp" (dp_shard x cp x tp / ep ranks; absent when that is 1).
    """

    def __init__(self, *, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1, pp: int = 1,
                 ep: int = 1, world_size: int = 1):
        from configuration.fields import ConfigError

        others = dp_replicate * cp * tp * pp
        if dp_shard == -1:
            if world_size % others != 0:
                raise ConfigError(
                    f"config error: parallelism: dp_replicate({dp_replicate}) x cp({cp}) x tp({tp}) x pp({pp}) = "
                    f"{others} does not divide the world size {world_size}; choose degrees whose product divides it")
            dp_shard = world_size // others
        product = dp_replicate * dp_shard * cp * tp * pp
        if product != world_size:
            raise ConfigError(
                f"config error: parallelism: dp_replicate({dp_replicate}) x dp_shard({dp_shard}) x cp({cp}) x "
                f"tp({tp}) x pp({pp}) = {product}, but the world size is {world_size}; make the product "
                f"{world_size} (e.g. set parallelism.data_parallel_shard_degree = -1)")
        if ep > 1 and (dp_shard * cp * tp) % ep != 0:
            raise ConfigError(
                f"config error: parallelism.expert_parallel_degree: {ep} must divide dp_shard({dp_shard}) x cp({cp}) x "
                f"tp({tp}) = {dp_shard * cp * tp}, the ranks experts borrow; pick a divisor of {dp_shard * cp * tp}")
        self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.ep = dp_replicate, dp_shard, cp, tp, pp, ep
        self.world_size = world_size
        self.device_type = "cpu"  # set by build_mesh
        self.world_mesh = None
        self.expert_meshes: dict = {}  # "ep" and, when dp_shard x cp x tp / ep > 1, "efsdp"

    @classmethod
    def from_config(cls, cfg: ParallelismConfig, world_size: int) -> "ParallelDims":
        return cls(dp_replicate=cfg.data_parallel_replicate_degree, dp_shard=cfg.data_parallel_shard_degree,
                   cp=cfg.context_parallel_degree, tp=cfg.tensor_parallel_degree, pp=cfg.pipeline_parallel_degree,
                   ep=cfg.expert_parallel_degree, world_size=world_size)

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def expert_fsdp_degree(self) -> int:
        """Ranks over which one EP rank's experts are FSDP-sharded: dp_shard x cp x tp / ep."""
        return self.dp_shard * self.cp * self.tp // self.ep if self.ep > 1 else self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

    def build_mesh(self, device_type: str):
        """Builds the world mesh (None on one rank) and its flattened views."""
        from torch.distributed.device_mesh import init_device_mesh

        self.device_type = device_type
        degrees = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                   "tp": self.tp}
        names = tuple(n for n in MESH_ORDER if degrees[n] > 1)
        if not names:
            return None
        mesh = init_device_mesh(device_type, tuple(degrees[n] for n in names), mesh_dim_names=names)
        for flat, parts in (("dp", ("dp_replicate", "dp_shard")), ("fsdp", ("dp_shard", "cp")),
                            ("dp_cp", ("dp_replicate", "dp_shard", "cp")),
                            ("dp_cp_tp", ("dp_replicate", "dp_shard", "cp", "tp"))):
            present = tuple(p for p in parts if p in names)
            if len(present) > 1:
                mesh[present]._flatten(flat)
        self.world_mesh = mesh
        if self.ep > 1:
            self._build_expert_meshes(mesh, names)
        return mesh

    def _build_expert_meshes(self, mesh, names) -> None:
        """Unflattens dp_shard x cp x tp (tp innermost) into (efsdp, ep), ep innermost. The new
        meshes share the world mesh's root, so FSDP can combine "efsdp" with "ep"."""
        borrowed = tuple(n for n in ("dp_shard", "cp", "tp") if n in names)
        efsdp = self.expert_fsdp_degree
        src = mesh[borrowed]
        if efsdp == 1:
            self.expert_meshes = {"ep": src._flatten("ep")}
            return
        if len(borrowed) > 1:
            src = src._flatten("expert_borrowed")
        sparse = src._unflatten(0, (efsdp, self.ep), ("efsdp", "ep"))
        self.expert_meshes = {"ep": sparse["ep"], "efsdp": sparse["efsdp"]}

    def expert_fsdp_mesh(self):
        """The mesh routed experts are FSDP-sharded over under EP: (dp_replicate, efsdp) for
        HSDP, "efsdp" alone, "dp_replicate" alone (sharded over the replicas), or None."""
        from torch.distributed.device_mesh import DeviceMesh

        shard, replicate = self.expert_meshes.get("efsdp"), self.mesh("dp_replicate")
        if shard is not None and replicate is not None:
            return DeviceMesh._concatenate([replicate, shard])
        return shard if shard is not None else replicate

    def mesh(self, name: str):
        """A named (possibly flattened) sub-mesh, or None when that dimension is 1."""
        if self.world_mesh is None:
            return None
        if name in self.expert_meshes:
            return self.expert_meshes[name]
        aliases = {"dp": ("dp_replicate", "dp_shard"), "fsdp": ("dp_shard", "cp"),
                   "dp_cp": ("dp_replicate", "dp_shard", "cp"), "dp_cp_tp": ("dp_replicate", "dp_shard", "cp", "tp")}
        names = self.world_mesh.mesh_dim_names
        if name in names:
            return self.world_mesh[name]
        present = tuple(p for p in aliases.get(name, ()) if p in names)
        if len(present) == 1:
            return self.world_mesh[present[0]]
        if len(present) > 1:
            return self.world_mesh[name]
        return None

    def fsdp_mesh(self):
        """The mesh dense params are sharded over: 1-D FSDP, 2-D (dp_replicate, shard) for HSDP, or None."""
        shard = self.mesh("fsdp")
        replicate = self.mesh("dp_replicate")
        if shard is not None and replicate is not None:
            shard_name = "fsdp" if self.dp_shard > 1 and self.cp > 1 else ("dp_shard" if self.dp_shard > 1 else "cp")
            return self.world_mesh["dp_replicate", shard_name]
        return shard if shard is not None else replicate

    def coordinate(self, name: str) -> int:
        m = self.mesh(name)
        return 0 if m is None else m.get_local_rank()
