"""Llama 3 <-> Hugging Face `LlamaForCausalLM`: names, layouts and config.

Our RoPE is the rotate-half layout (models/common/rope.py), which is the layout of
HF Llama checkpoints, so q/k weights load as they are: no permutation. The parity
tests (tests/test_hf_models.py) would catch a layout mismatch, since they use q/k
weights large enough that RoPE decides the attention pattern.

    tok_embeddings.weight                     model.embed_tokens.weight
    layers.{i}.attention.{wq,wk,wv,wo}        model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.attention_norm.weight          model.layers.{i}.input_layernorm.weight
    layers.{i}.ffn_norm.weight                model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.feed_forward.{w1,w2,w3}        model.layers.{i}.mlp.{gate,down,up}_proj.weight
    norm.weight                               model.norm.weight
    output.weight                             lm_head.weight (embed_tokens when tied)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from models.common.rope import RopeScaling
from models.hf_config import (
    HF_TOP_RENAMES,
    HFConfigError,
    HFStateDictAdapter,
    Recipe,
    Same,
    check_known_fields,
    dtype_name,
    parse_rope,
    require,
)
from models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from models.llama3.model import Llama3

_LAYER_RENAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_TOP_RENAMES = HF_TOP_RENAMES
_KNOWN_FIELDS = {
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
    "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "head_dim", "hidden_act", "attention_bias", "mlp_bias", "tie_word_embeddings", "attention_dropout",
}


def _ffn_layout(dim: int, hidden: int) -> tuple[float | None, int]:
    """(ffn_dim_multiplier, multiple_of) giving Llama3Args.ffn_hidden_dim == hidden."""
    for mult, multiple_of in ((None, 256), (1.3, 1024), (1.3, 4096), (1.2, 4096), (None, 32)):
        a = Llama3Args(dim=dim, ffn_dim_multiplier=mult, multiple_of=multiple_of)
        if a.ffn_hidden_dim == hidden:
            return mult, multiple_of
    base = int(2 * 4 * dim / 3)
    for mult in (hidden / base, (hidden + 0.5) / base):
        if Llama3Args(dim=dim, ffn_dim_multiplier=mult, multiple_of=1).ffn_hidden_dim == hidden:
            return mult, 1
    raise HFConfigError(f"hf error: llama: cannot express intermediate_size {hidden} for hidden_size {dim}")


class Llama3StateDictAdapter(HFStateDictAdapter):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    model_cls = Llama3

    def __init__(self, args: Llama3Args, hf_cfg: dict[str, Any] | None = None):
        super().__init__(args, hf_cfg)
        self.tied = bool(hf_cfg and hf_cfg.get("tie_word_embeddings", False))

    # ---- names ----
    def recipe_for(self, key: str) -> Recipe:
        if key == "output.weight" and self.tied:
            return Same("model.embed_tokens.weight")
        if key in _TOP_RENAMES:
            return Same(_TOP_RENAMES[key])
        m = re.match(r"^layers\.(\d+)\.(.+)$", key)
        if m and m.group(2) in _LAYER_RENAMES:
            return Same(f"model.layers.{m.group(1)}.{_LAYER_RENAMES[m.group(2)]}")
        raise HFConfigError(f"hf error: llama: no HF name for native key {key!r}")

    def is_ignored_hf_key(self, key: str) -> bool:
        return super().is_ignored_hf_key(key) or (self.tied and key == "lm_head.weight")

    # ---- config ----
    @classmethod
    def args_from_hf(cls, cfg: dict[str, Any]) -> Llama3Args:
        where = "llama config.json"
        require(cfg.get("model_type", "llama") == "llama",
                f"{where}: model_type {cfg.get('model_type')!r} is not 'llama'")
        check_known_fields(cfg, _KNOWN_FIELDS, where)
        require(cfg.get("hidden_act", "silu") == "silu", f"{where}: hidden_act {cfg.get('hidden_act')!r} != 'silu'")
        require(not cfg.get("attention_bias", False), f"{where}: attention_bias=true is not supported")
        require(not cfg.get("mlp_bias", False), f"{where}: mlp_bias=true is not supported")
        require(not cfg.get("attention_dropout", 0.0), f"{where}: attention_dropout must be 0")
        dim, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim")
        require(head_dim is None or head_dim * n_heads == dim,
                f"{where}: head_dim {head_dim} != hidden_size / num_attention_heads ({dim // n_heads})")
        rope = parse_rope(cfg, ("default", "llama3"), 10000.0, where)
        scaling = None
        if rope["rope_type"] == "llama3":
            scaling = RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                                  high_freq_factor=float(rope["high_freq_factor"]),
                                  original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
        mult, multiple_of = _ffn_layout(dim, int(cfg["intermediate_size"]))
        n_kv = cfg.get("num_key_value_heads")
        args = Llama3Args(
            dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=None if n_kv in (None, n_heads) else int(n_kv), vocab_size=int(cfg["vocab_size"]),
            multiple_of=multiple_of, ffn_dim_multiplier=mult, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]), rope_scaling=scaling,
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        )
        # Prefer a published flavor's spelling (multiple_of, ffn_dim_multiplier) when one matches.
        for flavor in LLAMA3_FLAVORS.values():
            if cls.signature(flavor) == cls.signature(args):
                return dataclasses.replace(flavor, max_seq_len=args.max_seq_len)
        return args

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        a: Llama3Args = self.args
        rope_scaling = None
        if a.rope_scaling is not None:
            s = a.rope_scaling
            rope_scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                            "high_freq_factor": s.high_freq_factor,
                            "original_max_position_embeddings": s.original_max_position_embeddings}
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "hidden_size": a.dim, "intermediate_size": a.ffn_hidden_dim, "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
            "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps, "max_position_embeddings": a.max_seq_len,
            # Legacy RoPE spelling: read by every transformers release since Llama 3.1, current ones included.
            "rope_theta": a.rope_theta, "rope_scaling": rope_scaling,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
            "torch_dtype": dtype_name(dtype),
        }

    @staticmethod
    def signature(args: Llama3Args) -> dict[str, Any]:
        return {
            "dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.kv_heads,
            "vocab_size": args.vocab_size, "ffn_hidden_dim": args.ffn_hidden_dim, "norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": dataclasses.asdict(args.rope_scaling) if args.rope_scaling else None,
        }
