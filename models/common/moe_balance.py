"""Step-level MoE balancing over a model's MoE layers: the aux-loss-free bias update, the
load counters and their metrics, and the balance loss's normalisation and logging.

The layer (models/common/moe.py) only counts picks and adds its balance loss in forward;
what happens between optimizer steps (summing the loads over ranks, moving `expert_bias`,
dropping a skipped step's loads, telling the layers the global batch size) is the
trainer's side and lives here, so the layer file stays about the forward.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from models.common.moe import MoE, moe_layers


@torch.no_grad()
def update_moe_load_balance_bias(model: nn.Module | Iterable[nn.Module], coeff: float = 1e-3,
                                 dp_group=None) -> torch.Tensor | None:
    """Aux-loss-free balancing step (call after each optimizer step).

    For every MoE layer in `model` (a module, or a list of pipeline model parts):
    sum `tokens_per_expert` over `dp_group` (a ProcessGroup or 1-D DeviceMesh; one
    all-reduce for all layers), then expert_bias += coeff * sign(mean - count), and zero
    the counters. Layers that saw no tokens are left unchanged.

    Returns the summed loads [L, E] (fp32, MoE layers in module order) that drove the
    update, or None without MoE layers; see `expert_load_metrics`."""
    layers = moe_layers(model)
    if not layers:
        return None
    counts = torch.stack([m.tokens_per_expert for m in layers]).to(torch.float32)
    if dp_group is not None and dist.is_available() and dist.is_initialized():
        group = dp_group.get_group() if hasattr(dp_group, "get_group") else dp_group
        dist.all_reduce(counts, group=group)
    delta = coeff * torch.sign(counts.mean(dim=1, keepdim=True) - counts)
    for m, d in zip(layers, delta):
        m.expert_bias.add_(d.to(m.expert_bias.dtype))
        m.tokens_per_expert.zero_()
    return counts


def moe_load_counters(model: nn.Module | Iterable[nn.Module]) -> list[torch.Tensor]:
    """Every MoE layer's `tokens_per_expert` (int64 [E]: its picks since the last bias update),
    in `moe_layers` order. For a caller that must sum the loads over ranks outside the model's
    mesh before `moe_post_optimizer_step` adds the mesh's share: torchft replica groups sum them
    across the groups, in place (trainer/fault_tolerance/replicas.py); a sum in either order
    is the global load, so every replica of a layer moves its bias the same way."""
    return [m.tokens_per_expert for m in moe_layers(model)]


@torch.no_grad()
def discard_moe_loads(model: nn.Module | Iterable[nn.Module]) -> None:
    """Zeroes every MoE layer's load counters without a bias update: the optimizer step they
    were counted for was skipped (ModelSpec.skipped_step_fn), so its routing must not steer
    the next update either."""
    for m in moe_layers(model):
        m.tokens_per_expert.zero_()


def moe_post_optimizer_step(model, parallel_dims=None, *, with_metrics: bool = True,
                            default_coeff: float = 1e-3) -> dict[str, float]:
    """A `ModelSpec.post_optimizer_step_fn` for MoE families, called as (model_part, ParallelDims,
    with_metrics=whether this step is logged). Loads are summed over every rank of the pipeline
    stage ("dp_cp_tp": data ranks route different tokens, and so do TP ranks under sequence
    parallel; without SP the TP ranks count the same tokens, a uniform factor the sign-based
    update ignores), so every replica of a layer applies the same bias update, at the rate
    `model.args.load_balance_coeff` (`default_coeff` for a model without it; 0 leaves the bias
    at zero). Returns the step's expert-load metrics (`expert_load_metrics`), computed before
    the counters are zeroed."""
    coeff = getattr(getattr(model, "args", None), "load_balance_coeff", default_coeff)
    group = parallel_dims.mesh("dp_cp_tp") if parallel_dims is not None else None
    counts = update_moe_load_balance_bias(model, coeff=coeff, dp_group=group)
    return expert_load_metrics(moe_layer_ids(model), counts) if with_metrics else {}


def set_aux_loss_sequences(model: nn.Module | Iterable[nn.Module], sequences_per_step: int) -> None:
    """Normalises every MoE layer's balance loss by the number of sequences in one optimizer
    step over all data-parallel ranks (the global batch), so that its gradient is that of
    one global mean whatever the split (`AddAuxLoss`). A no-op without MoE layers."""
    for m in moe_layers(model):
        m.aux_loss_scale = 1.0 / sequences_per_step


def moe_layer_ids(model: nn.Module | Iterable[nn.Module]) -> list[str]:
    """The block key ("3" for `layers.3...moe`) of each MoE layer, in `moe_layers` order."""
    parts = [model] if isinstance(model, nn.Module) else list(model)
    ids = []
    for part in parts:
        for name, m in part.named_modules():
            if isinstance(m, MoE):
                found = re.search(r"(?:^|\.)layers\.([^.]+)\.", name)
                ids.append(found.group(1) if found else name)
    return ids


def expert_load_metrics(layer_ids: list[str], counts: torch.Tensor | None) -> dict[str, float]:
    """Per-layer expert load from summed loads [L, E] (`update_moe_load_balance_bias`'s
    result): `moe/layer{i}_max_over_mean` (1 = balanced; E / top_k when every token picks
    the same experts) and `moe/layer{i}_idle_experts` (experts that got no token), plus
    their max over layers, `moe/max_over_mean`. Layers that saw no tokens are skipped.
    One device-to-host copy."""
    if counts is None or counts.numel() == 0:
        return {}
    mean = counts.mean(dim=1)
    stats = torch.stack([counts.amax(dim=1) / mean.clamp_min(1e-12), (counts == 0).sum(dim=1).to(counts.dtype),
                         mean], dim=1).tolist()
    out: dict[str, float] = {}
    for lid, (ratio, idle, avg) in zip(layer_ids, stats):
        if avg > 0:
            out[f"moe/layer{lid}_max_over_mean"] = ratio
            out[f"moe/layer{lid}_idle_experts"] = idle
    ratios = [v for k, v in out.items() if k.endswith("_max_over_mean")]
    if ratios:
        out["moe/max_over_mean"] = max(ratios)
    return out


def moe_aux_loss(model: nn.Module | Iterable[nn.Module]) -> torch.Tensor | None:
    """Sum of the last forward's balance losses over the MoE layers (detached, for logging);
    None for a model without MoE layers."""
    layers = moe_layers(model)
    if not layers:
        return None
    return torch.stack([m.aux_loss for m in layers]).sum()
