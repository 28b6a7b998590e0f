"""The one object a model package exports to the trainer, and the contract it promises.

The trainer never imports a model module directly: it looks a `ModelSpec` up by name
(`models.get_model_spec`) and uses only what the spec offers. Adding a model means
adding a folder with a spec (see docs/extending.md), not editing the trainer.

Contract, written as Protocols so that it is checkable and documented in one place:
- `ModelArgs`: the attributes of the args dataclass that the trainer, the parallelism
  checks and the estimator read (the rest is the model's own business);
- `DecoderModel`: the module layout every plan relies on. Blocks live in a
  `ModuleDict` `layers` keyed "0".."L-1" (PP deletes the ones a stage does not own,
  names stay stable for DCP; AC wraps each one); `tok_embeddings`, `norm`, `output`
  may be None on a pipeline stage; `forward(tokens, positions=None)`;
  `init_weights(buffer_device)` initialises every parameter and buffer of the
  (possibly split) model and draws randomness only into the parameters themselves
  (see parallelisms/param_init.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch
import torch.nn as nn


@runtime_checkable
class ModelArgs(Protocol):
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    max_seq_len: int
    # Optional: n_kv_heads (GQA; TP must divide it too); MoE models: n_routed_experts.


@runtime_checkable
class DecoderModel(Protocol):
    args: Any
    tok_embeddings: nn.Module | None
    layers: nn.ModuleDict
    norm: nn.Module | None
    output: nn.Module | None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor: ...

    def init_weights(self, buffer_device: torch.device | None = None) -> None: ...


# The builders and hooks a spec may provide.
ModelBuilder = Callable[[Any], nn.Module]                         # args -> model (called on the meta device)
TensorParallelPlan = Callable[[nn.Module, Any, Any], None]         # (part, tp_mesh, parallelism_cfg), in place
ExpertParallelPlan = Callable[[nn.Module, Any, Any], None]         # (part, ParallelDims, parallelism_cfg)
PostOptimizerStepHook = Callable[..., dict[str, float]]            # (part, ParallelDims, *, with_metrics) -> metrics
SummaryFn = Callable[[nn.Module, Any, int], dict[str, float]]      # (meta model, args, seq_len) -> params, FLOPs
StateDictAdapterClass = Any                                        # HF <-> native names (models/hf_config.py)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    # Flavor name -> model args (e.g. "debug", "8B").
    flavors: dict[str, Any]
    model_cls: ModelBuilder
    tensor_parallel_fn: TensorParallelPlan | None = None
    expert_parallel_fn: ExpertParallelPlan | None = None  # MoE models only
    # Activation-checkpoint mode -> the policy class this model uses for it, replacing the
    # default of parallelisms/activation_checkpoint.py (a subclass or parameterisation of it,
    # e.g. DeepSeek's MoE rules for "op"). Modes not listed use the default policy.
    ac_policies: dict[str, Any] = field(default_factory=dict)
    state_dict_adapter: StateDictAdapterClass = None
    # Called after each optimizer step (e.g. MoE load-balance bias update).
    post_optimizer_step_fn: PostOptimizerStepHook | None = None
    # Called on each model part instead when the step guard skips the optimizer step: the step
    # leaves no trace (MoE: its expert loads do not feed the next bias update).
    skipped_step_fn: Callable[[nn.Module], None] | None = None
    # `model` may live on the meta device. Used by --dry-run, metrics (MFU) and the estimator;
    # returns {"params", "flops_per_token", optional "activated_params"}.
    summary_fn: SummaryFn | None = None

    @property
    def sac_save_ops(self) -> frozenset:
        """The ops this model's op-level AC policy always saves on top of the defaults."""
        return frozenset(getattr(self.ac_policies.get("op"), "spec_save_ops", frozenset()))

    @property
    def sac_force_recompute_fqns(self) -> tuple[str, ...]:
        """Module-name patterns whose matmuls this model's op-level AC policy recomputes."""
        return tuple(getattr(self.ac_policies.get("op"), "spec_force_recompute_fqns", ()))
