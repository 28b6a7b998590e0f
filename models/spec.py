"""The one object a model package exports to the trainer.

The trainer never imports a model module directly: it looks up a `ModelSpec` by
name in `models.MODEL_SPECS` and uses only what the spec offers. Adding a model
means adding a folder with a spec, not editing the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn


@dataclass(frozen=True)
class ModelSpec:
    name: str
    # Flavor name -> model args dataclass instance (e.g. "debug", "8B").
    flavors: dict[str, Any]
    # Builds the model from args; called under a meta-device context by the trainer.
    model_cls: Callable[[Any], nn.Module]
    # (model, tp_mesh, parallelism_config) -> None. Applies the TP/SP plan by module name.
    tensor_parallel_fn: Callable[..., None] | None = None
    # (model, ep_mesh, ...) -> None. Shards routed experts; only MoE models set it.
    expert_parallel_fn: Callable[..., None] | None = None
    # Extra aten ops the op-level activation-checkpoint policy must always save.
    sac_save_ops: frozenset = field(default_factory=frozenset)
    # Module-name patterns whose matmuls are always recomputed (e.g. a MoE router gate).
    sac_force_recompute_fqns: tuple[str, ...] = ()
    # HF <-> native state-dict name mapping (class with to_hf / from_hf), if any.
    state_dict_adapter: Any = None
    # Called after each optimizer step (e.g. MoE load-balance bias update), or None.
    post_optimizer_step_fn: Callable[..., None] | None = None
    # (model, args, seq_len) -> {"params": ..., "flops_per_token": ..., optional "activated_params"}.
    # `model` may live on the meta device. Used by --dry-run, metrics (MFU) and the memory estimator.
    summary_fn: Callable[..., dict[str, float]] | None = None

    def args_for(self, flavor: str):
        if flavor not in self.flavors:
            raise KeyError(flavor)
        return self.flavors[flavor]
