"""Qwen3 <-> Hugging Face `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`: names, layouts and config.

One adapter reads both model types (`qwen3`, `qwen3_moe`): a dense config is a MoE one
without experts. RoPE is rotate-half in both (no q/k permutation). Names, per block i:

    layers.{i}.attention.{wq,wk,wv,wo}      model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.attention.{q,k}_norm         model.layers.{i}.self_attn.{q,k}_norm.weight
    layers.{i}.attention_norm               model.layers.{i}.input_layernorm.weight
    layers.{i}.ffn_norm                     model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.feed_forward.{w1,w2,w3}      model.layers.{i}.mlp.{gate,down,up}_proj.weight
    layers.{i}.moe.router.gate              model.layers.{i}.mlp.gate.weight
    layers.{i}.moe.experts.{w1,w3,w2}[e]    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight, transposed
    layers.{i}.moe.expert_bias              (none: Qwen3 has no routing bias; loads as zeros, must stay zero)
    tok_embeddings / norm / output          model.embed_tokens / model.norm / lm_head (embed_tokens when tied)

The per-expert keys are the on-disk layout of the Hub checkpoints, and what transformers
5 writes with `save_pretrained` (it fuses the experts only in memory).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from models.hf_config import (HF_EXPERT_PROJ, HF_TOP_RENAMES, Absent, HFConfigError, HFStateDictAdapter, Recipe, Same,
                              StackedTransposed, Tied, check_known_fields, dtype_name, parse_rope, require)
from models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from models.qwen3.model import Qwen3

_LAYER_RENAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
}
_EXPERT_PROJ = HF_EXPERT_PROJ
_TOP_RENAMES = HF_TOP_RENAMES
_DENSE_FIELDS = {
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "hidden_act", "attention_bias", "attention_dropout", "tie_word_embeddings", "layer_types", "max_window_layers",
    "sliding_window", "use_sliding_window",
}
_MOE_FIELDS = _DENSE_FIELDS | {"moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
                               "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}



def hf_aux_coef(a: Qwen3Args) -> float:
    """HF's router_aux_loss_coef for our balance loss: the same number for scope "model" (the same
    loss); for a loss per layer (each 1 when balanced, HF's pooled one top_k), the coefficient
    whose router gradients equal ours when every layer's loads are equal: coeff x L / top_k."""
    if a.aux_loss_scope == "model":
        return a.aux_loss_coeff
    return a.aux_loss_coeff * a.n_moe_layers / a.n_activated_experts


def balance_note(a: Qwen3Args, cfg: dict) -> str | None:
    """One line: the balancing an imported Qwen3-MoE folder trains with (None for a dense model)."""
    if not a.moe_enabled:
        return None
    hf = (f"config.json: output_router_logits {str(bool(cfg.get('output_router_logits'))).lower()}, "
          f"router_aux_loss_coef {cfg.get('router_aux_loss_coef')}")
    bias = f"; aux-loss-free bias update rate {a.load_balance_coeff}" if a.load_balance_coeff else ""
    if a.aux_loss_coeff == 0:
        return (f"MoE balancing: no balance loss ({hf}; HF trains without one){bias}; add HF's with "
                "--moe.aux_loss_coeff 0.001")
    what = {"model": f"HF's load_balancing_loss_func, one loss over all {a.n_moe_layers} MoE layers",
            "batch": f"one Switch loss per MoE layer ({a.n_moe_layers} layers)",
            "sequence": "a per-sequence loss per MoE layer"}[a.aux_loss_scope]
    return f"MoE balancing: {what}, coefficient {a.aux_loss_coeff} ({hf}){bias}"

class Qwen3StateDictAdapter(HFStateDictAdapter):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    also_reads = ("qwen3_moe",)
    model_cls = Qwen3
    balance_note = staticmethod(balance_note)  # logged by the trainer when it trains from an HF folder

    # ---- names ----
    def recipe_for(self, key: str) -> Recipe:
        a: Qwen3Args = self.args
        if key == "output.weight" and a.tie_embeddings:
            return Tied(_TOP_RENAMES["tok_embeddings.weight"])
        if key in _TOP_RENAMES:
            return Same(_TOP_RENAMES[key])
        m = re.match(r"^layers\.(\d+)\.(.+)$", key)
        if m:
            prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
            if rest in _LAYER_RENAMES:
                return Same(prefix + _LAYER_RENAMES[rest])
            if rest == "moe.expert_bias":
                return Absent()
            em = re.match(r"^moe\.experts\.(w[123])$", rest)
            if em:
                proj = _EXPERT_PROJ[em.group(1)]
                return StackedTransposed([f"{prefix}mlp.experts.{e}.{proj}.weight" for e in range(a.n_routed_experts)])
        raise HFConfigError(f"hf error: qwen3: no HF name for native key {key!r}")

    def is_ignored_hf_key(self, key: str) -> bool:
        return super().is_ignored_hf_key(key) or (self.args.tie_embeddings and key == "lm_head.weight")

    def check_exportable(self, sd: dict[str, torch.Tensor]) -> str | None:
        moved = sorted(k for k, v in sd.items() if k.endswith("moe.expert_bias") and bool(v.abs().max() > 0))
        if moved:
            return (f"hf error: {moved[0]} is non-zero (moe.bias_update_rate > 0 trained a routing bias) and "
                    f"Qwen3's HF format has no routing bias; train with --moe.bias_update_rate 0 to export")
        return None

    def export_problem(self, trained: bool = False) -> str | None:
        if trained and self.args.moe_enabled and self.args.load_balance_coeff > 0:
            return ("moe.bias_update_rate > 0 trains a routing bias that Qwen3's HF format cannot hold; set "
                    "--moe.bias_update_rate 0")
        return None

    # ---- config ----
    @classmethod
    def args_from_hf(cls, cfg: dict[str, Any]) -> Qwen3Args:
        model_type = cfg.get("model_type", "qwen3")
        where = f"{model_type} config.json"
        require(model_type in cls.reads_model_types(),
                f"{where}: model_type {model_type!r} is not one of {list(cls.reads_model_types())}")
        moe = model_type == "qwen3_moe"
        check_known_fields(cfg, _MOE_FIELDS if moe else _DENSE_FIELDS, where)
        require(cfg.get("hidden_act", "silu") == "silu", f"{where}: hidden_act {cfg.get('hidden_act')!r} != 'silu'")
        require(not cfg.get("attention_bias", False), f"{where}: attention_bias=true is not supported")
        require(not cfg.get("attention_dropout", 0.0), f"{where}: attention_dropout must be 0")
        require(not cfg.get("use_sliding_window", False), f"{where}: use_sliding_window=true is not supported")
        layer_types = cfg.get("layer_types") or []
        require(all(t == "full_attention" for t in layer_types),
                f"{where}: layer_types {sorted(set(layer_types))} are not supported (only full_attention)")
        rope = parse_rope(cfg, ("default",), 10000.0, where)
        dim, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        n_kv = cfg.get("num_key_value_heads") or n_heads
        fields: dict[str, Any] = dict(
            dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=n_heads, n_kv_heads=int(n_kv),
            head_dim=int(cfg.get("head_dim") or dim // n_heads), vocab_size=int(cfg["vocab_size"]),
            ffn_hidden_dim=int(cfg["intermediate_size"]), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]), max_seq_len=int(cfg.get("max_position_embeddings", 40960)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))
        if moe:
            n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
            require(n_experts is not None, f"{where}: num_experts is missing")
            # HF trains with its balance loss only under output_router_logits; ours with scope "model" is
            # that loss (one over every MoE layer), so the coefficient carries over as it is.
            aux = float(cfg.get("router_aux_loss_coef", 0.001)) if cfg.get("output_router_logits") else 0.0
            fields.update(
                n_routed_experts=int(n_experts), n_activated_experts=int(cfg["num_experts_per_tok"]),
                moe_inter_dim=int(cfg["moe_intermediate_size"]), route_norm=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
                mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []], aux_loss_coeff=aux,
                aux_loss_scope="model")
            require(fields["decoder_sparse_step"] >= 1, f"{where}: decoder_sparse_step must be >= 1")
        args = Qwen3Args(**fields)
        # Prefer a published flavor's spelling (its training defaults, e.g. the aux loss) when one matches.
        for flavor in QWEN3_FLAVORS.values():
            if cls.signature(flavor) == cls.signature(args):
                return dataclasses.replace(flavor, max_seq_len=args.max_seq_len, aux_loss_coeff=aux if moe else 0.0,
                                           aux_loss_scope=args.aux_loss_scope)
        return args

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        a: Qwen3Args = self.args
        cfg = {
            "architectures": ["Qwen3MoeForCausalLM" if a.moe_enabled else self.architecture],
            "model_type": "qwen3_moe" if a.moe_enabled else self.model_type,
            "hidden_size": a.dim, "intermediate_size": a.ffn_hidden_dim, "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
            "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps, "max_position_embeddings": a.max_seq_len,
            # Legacy RoPE spelling: read by every transformers release, current ones included.
            "rope_theta": a.rope_theta, "rope_scaling": None,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "use_sliding_window": False, "sliding_window": None,
            "tie_word_embeddings": a.tie_embeddings, "initializer_range": 0.02, "use_cache": True,
            "torch_dtype": dtype_name(dtype),
        }
        if a.moe_enabled:
            cfg.update({
                "num_experts": a.n_routed_experts, "num_experts_per_tok": a.n_activated_experts,
                "moe_intermediate_size": a.moe_inter_dim, "norm_topk_prob": a.route_norm,
                "decoder_sparse_step": a.decoder_sparse_step, "mlp_only_layers": list(a.mlp_only_layers),
                "output_router_logits": a.aux_loss_coeff > 0,
                "router_aux_loss_coef": hf_aux_coef(a) if a.aux_loss_coeff else 0.001,
            })
        return cfg

    @staticmethod
    def signature(args: Qwen3Args) -> dict[str, Any]:
        sig = {
            "dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "vocab_size": args.vocab_size, "ffn_hidden_dim": args.ffn_hidden_dim,
            "norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "tie_embeddings": args.tie_embeddings,
            "n_routed_experts": args.n_routed_experts,
        }
        if args.moe_enabled:
            sig.update({"n_activated_experts": args.n_activated_experts, "moe_inter_dim": args.moe_inter_dim,
                        "route_norm": args.route_norm,
                        "moe_layers": [i for i in range(args.n_layers) if args.is_moe_layer(i)]})
        return sig
