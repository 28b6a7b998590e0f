"""Model args, resolved once: `resolve_model(cfg) -> (spec, args)`.

The shape of the model comes from one of two places: `model.name` + `model.flavor` (a
named args dataclass of the spec), or, with `model.hf_path`, the folder's config.json,
so that a published checkpoint trains with one option and no flavor of its own. Config
overrides (`model.mtp_depth`, the `[moe]` knobs) are then applied to those args with
`dataclasses.replace`. `JobConfig.validate` calls `resolve_model` once and keeps the
result; the trainer, the parallelism checks, the dry run and the memory estimator all
read `cfg.model_spec` and `cfg.model_args`, so a field that changes the shape is
applied in exactly one place.

The `[moe]` section lives here, not in models/common/moe.py: models know nothing of
the trainer's config (layering), and resolve_model maps the section onto the fields
of the model's args.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from configuration.fields import ConfigError, opt

DEFAULT_MODEL, DEFAULT_FLAVOR = "llama3", "debug"


@dataclass
class MoEConfig:
    """[moe]: routing and load balancing of mixture-of-experts models (DeepSeek V3, Qwen3 MoE).
    Every field defaults to None, the model's own value; docs/moe.md has the semantics table."""

    bias_update_rate: float | None = opt(
        None, "Auxiliary-loss-free balancing: after each optimizer step expert_bias += rate * sign(mean load - "
        "load). 0 freezes the routing bias. Default: the model's own (1e-3 for DeepSeek V3).", min=0.0)
    aux_loss_coeff: float | None = opt(
        None, "Coefficient of the balance loss (DeepSeek V3's alpha; with scope model HF's router_aux_loss_coef), "
        "normalised once per global batch; 0 = off. Default: the model's own (DeepSeek V3 0; Qwen3 MoE flavors "
        "0.001, debug_moe 0.002 per layer; from an HF folder its router_aux_loss_coef, or 0 with output_router_logits false).", min=0.0)
    aux_loss_scope: str | None = opt(
        None, "What one balance-loss term covers. sequence: each sequence (DeepSeek V3), averaged over the global "
        "batch's sequences whatever the layout. batch: all tokens of one forward (a microbatch on one data rank, "
        "whole sequences under CP and sequence parallel), weighted by its share of the global batch's sequences "
        "(per layer). model: the batch scope's tokens pooled over every MoE layer of the forward into one "
        "loss, HF's Qwen3-MoE load_balancing_loss_func (refused under PP: stages hold different layers). Default: "
        "the model's own (DeepSeek V3 sequence, Qwen3 model, its debug_moe flavor batch).",
        choices=("sequence", "batch", "model"))
    route_norm: bool | None = opt(
        None, "Normalise each token's top-k routing weights to sum to 1 (before the model's route scale). "
        "Default: the model's own (DeepSeek V3 sigmoid routing and Qwen3: true; DeepSeek softmax routing, "
        "as V2 / the 16B flavor: false).")


# [moe] field -> the model-args field it sets.
_MOE_FIELDS = {"bias_update_rate": "load_balance_coeff", "aux_loss_coeff": "aux_loss_coeff",
               "aux_loss_scope": "aux_loss_scope", "route_norm": "route_norm"}


def unknown_value(key: str, value: str, valid: list[str], where: str = "") -> str:
    close = difflib.get_close_matches(value, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"config error: {key}: unknown value {value!r}{where}{hint}; valid: {', '.join(valid)}"


def _spec(name: str):
    from models import get_model_spec, model_names

    try:
        return get_model_spec(name)
    except KeyError:
        raise ConfigError(unknown_value("model.name", name, model_names())) from None


def _from_hf(m) -> tuple[Any, Any]:
    from models.hf_config import HFConfigError, matching_flavors, model_from_hf_folder, read_hf_config

    folder = Path(m.hf_path)
    try:
        name, args = model_from_hf_folder(folder)
        hf_cfg = read_hf_config(folder)
    except HFConfigError as e:
        raise ConfigError("config error: model.hf_path: " + str(e).removeprefix("hf error: ")) from None
    spec = _spec(name)
    if m.name is not None and m.name != name:
        model_type = hf_cfg.get("model_type")
        ours = "" if model_type == name else f" (our {name})"
        raise ConfigError(f"config error: model.name: {folder}/config.json holds a {model_type!r} model{ours}, not "
                          f"{m.name!r}; pass --model.name {name} or drop model.name (model.hf_path sets it)")
    if m.flavor is not None:
        if m.flavor not in spec.flavors:
            raise ConfigError(unknown_value("model.flavor", m.flavor, list(spec.flavors), f" for {name}"))
        diff = spec.state_dict_adapter(spec.flavors[m.flavor]).mismatches(args)
        if diff:
            fits = matching_flavors(spec, args)
            hint = f"use --model.flavor {fits[0]}" if fits else "drop model.flavor (model.hf_path gives the shape)"
            raise ConfigError(f"config error: model.flavor: {m.flavor} does not match {folder}/config.json "
                              f"(config.json vs flavor: {'; '.join(diff)}); {hint}")
    if m.mtp_depth > 0 and hasattr(args, "mtp_depth"):  # (a model without MTP is refused in _apply_overrides)
        stored = spec.state_dict_adapter.hf_mtp_layers(hf_cfg)
        if m.mtp_depth > stored:
            raise ConfigError(f"config error: model.mtp_depth: {folder} holds {stored} multi-token-prediction "
                              f"layer(s) (num_nextn_predict_layers) and cannot initialise {m.mtp_depth}; use "
                              f"--model.mtp_depth {stored}")
    return spec, args


def _from_flavor(m) -> tuple[Any, Any]:
    spec = _spec(m.name or DEFAULT_MODEL)
    flavor = m.flavor or DEFAULT_FLAVOR
    if flavor not in spec.flavors:
        raise ConfigError(unknown_value("model.flavor", flavor, list(spec.flavors), f" for {spec.name}"))
    return spec, spec.flavors[flavor]


def _apply_overrides(cfg, spec, args):
    m, moe = cfg.model, getattr(cfg, "moe", None)
    fields = {f.name for f in dataclasses.fields(args)}
    changes: dict[str, Any] = {}
    if m.mtp_depth > 0:
        if "mtp_depth" not in fields:
            raise ConfigError(f"config error: model.mtp_depth: {spec.name} has no multi-token prediction; set it "
                              "to 0")
        changes["mtp_depth"] = m.mtp_depth
    elif "mtp_depth" in fields:
        changes["mtp_depth"] = 0
    for key, field in _MOE_FIELDS.items():
        value = getattr(moe, key, None) if moe is not None else None
        if value is None:
            continue
        if field not in fields or getattr(args, "n_routed_experts", 1) == 0:  # (a dense Qwen3 flavor)
            label = f"{spec.name} from {m.hf_path}" if m.hf_path else f"{spec.name} {m.flavor or DEFAULT_FLAVOR}"
            raise ConfigError(f"config error: moe.{key}: {label} has no mixture-of-experts layers; drop it")
        changes[field] = value
    return dataclasses.replace(args, **changes) if changes else args


def resolve_model(cfg) -> tuple[Any, Any]:
    """(ModelSpec, model args) of the run `cfg` (a JobConfig) describes, or a one-line
    ConfigError. Writes the resolved model name (and flavor, without hf_path) back into
    cfg.model, so printed configs and logs show what is built."""
    m = cfg.model
    spec, args = _from_hf(m) if m.hf_path else _from_flavor(m)
    args = _apply_overrides(cfg, spec, args)
    m.name = spec.name
    if not m.hf_path:
        m.flavor = m.flavor or DEFAULT_FLAVOR
    return spec, args


def check_hf_export(cfg) -> None:
    """checkpoint.last_save_in_hf for a model the HF format could not hold after training:
    refused before the first step (e.g. the 16B flavor's softmax routing exports as DeepSeek
    V2, which has no routing bias for aux-loss-free balancing to train)."""
    if not cfg.checkpoint.last_save_in_hf:
        return
    spec, args = cfg.model_spec, cfg.model_args
    if spec.state_dict_adapter is None:
        raise ConfigError(f"config error: checkpoint.last_save_in_hf: {spec.name} has no Hugging Face format; "
                          "set it to false")
    adapter = spec.state_dict_adapter.for_args(args)
    problem = adapter.export_problem(trained=True)
    if problem:
        raise ConfigError(f"config error: checkpoint.last_save_in_hf: {model_label(cfg)} cannot be exported to "
                          f"HF {adapter.model_type}: {problem}")


def model_label(cfg) -> str:
    """`llama3 8B` or `deepseek_v3 from /data/DeepSeek-V3`, for logs and messages."""
    m = cfg.model
    return f"{m.name} from {m.hf_path}" if m.hf_path else f"{m.name} {m.flavor}"


def describe_args(args: Any) -> str:
    """The resolved shape, one `field=value` per args field, for the dry run."""
    return ", ".join(f"{f.name}={getattr(args, f.name)!r}" for f in dataclasses.fields(args))


def tokenizer_path(cfg, default: str) -> str:
    """model.tokenizer_path, else the HF folder's own tokenizer, else `default`."""
    m = cfg.model
    return m.tokenizer_path or m.hf_path or default


def check_tokenizer_fits(tokenizer, args, label: str) -> None:
    """A model vocab at least the tokenizer's (real checkpoints pad their embeddings), or one line."""
    vocab = getattr(args, "vocab_size", None)
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"config error: model.tokenizer_path: the tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens "
            f"but {label} has vocab_size {vocab}; use the model's own tokenizer (an HF model folder's, or the one "
            "it was trained with) or a model with a larger vocabulary")
