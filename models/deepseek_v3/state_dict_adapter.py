"""DeepSeek V3 <-> Hugging Face `DeepseekV3ForCausalLM`: names, layouts and config.

Names (i = layer, e = routed expert):

    tok_embeddings.weight                 model.embed_tokens.weight
    layers.{i}.attention_norm.weight      model.layers.{i}.input_layernorm.weight
    layers.{i}.ffn_norm.weight            model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.attention.wq               ...self_attn.q_proj            (no q LoRA; rope rows permuted)
    layers.{i}.attention.wq_a / q_norm    ...self_attn.q_a_proj / q_a_layernorm
    layers.{i}.attention.wq_b             ...self_attn.q_b_proj          (rope rows permuted)
    layers.{i}.attention.wkv_a            ...self_attn.kv_a_proj_with_mqa (rope rows permuted)
    layers.{i}.attention.kv_norm / wkv_b  ...self_attn.kv_a_layernorm / kv_b_proj
    layers.{i}.attention.wo               ...self_attn.o_proj
    layers.{i}.feed_forward.{w1,w2,w3}    ...mlp.{gate,down,up}_proj       (dense first layers)
    layers.{i}.moe.router.gate.weight     ...mlp.gate.weight
    layers.{i}.moe.expert_bias            ...mlp.gate.e_score_correction_bias
    layers.{i}.moe.experts.w1[e]          ...mlp.experts.{e}.gate_proj.weight, transposed
    layers.{i}.moe.experts.w3[e]          ...mlp.experts.{e}.up_proj.weight, transposed
    layers.{i}.moe.experts.w2[e]          ...mlp.experts.{e}.down_proj.weight, transposed
    layers.{i}.moe.shared_experts.{w1,w2,w3}  ...mlp.shared_experts.{gate,down,up}_proj
    norm.weight / output.weight           model.norm.weight / lm_head.weight

RoPE: DeepSeek's checkpoints (HF `rope_interleave: true`, the default) pair rope
channels (2i, 2i+1); our MLA pairs (i, i + d/2) (rotate-half). Rows of q_proj /
q_b_proj (the last `qk_rope_head_dim` rows of every head) and of kv_a_proj_with_mqa
(its last `qk_rope_head_dim` rows) are permuted on import and back on export.
HF's DeepSeek RoPE maps an interleaved pair (2i, 2i+1) to output channels (i, i+d/2),
so after the permutation both models compute the same q.k products.

Multi-token prediction: MTP module k (`mtp.{k}.*`, with `--model.mtp_depth`) is HF
layer `model.layers.{n_layers + k}`: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`
(our `mtp.{k}.norm`) and a block with a layer's names. The hub layout also stores the
shared embedding and head there (`embed_tokens`, `shared_head.head`): they are
written on export as copies of the main ones and not read on import. MTP layers
beyond mtp_depth are ignored.

FP8 block-quantized weights (`quantization_config` with quant_method fp8, DeepSeek
V3 on the Hub) are dequantized by the reader (trainer/hf_io.py); exports are written
in the export dtype, unquantized.

Softmax routing is DeepSeek V2's model_type (`DeepSeekV2StateDictAdapter`, below),
which our softmax models (the 16B flavor) import from and export to.

Not representable (one-line error): rope types other than default/yarn, YaRN
settings that scale cos/sin (mscale != mscale_all_dim), other quantizations. Note:
HF hard-codes eps=1e-6 for q_a_layernorm / kv_a_layernorm while our q_norm / kv_norm
use norm_eps; they agree for every published config.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from models.deepseek_v3.model import DeepSeekV3
from models.hf_config import (
    HF_EXPERT_PROJ,
    HF_TOP_RENAMES,
    Absent,
    HFConfigError,
    HFStateDictAdapter,
    Recipe,
    RowPermuted,
    Same,
    SameWithCopies,
    StackedTransposed,
    check_known_fields,
    dtype_name,
    fp8_block_size,
    half_rope_rows_perm,
    layer_index,
    parse_rope,
    require,
)

_LAYER_RENAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
# MTP layer k (native `mtp.{k}.*`) is HF layer n_layers + k; its block keys are a layer's.
_MTP_RENAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_EXPERT_RENAMES = HF_EXPERT_PROJ
_TOP_RENAMES = HF_TOP_RENAMES
_KNOWN_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts", "routed_scaling_factor",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_head_dim", "head_dim",
    "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "rope_interleave",
    "attention_bias", "attention_dropout", "tie_word_embeddings", "num_nextn_predict_layers", "num_mtp_layers",
    "scoring_func", "topk_method", "moe_layer_freq", "ep_size", "aux_loss_alpha", "seq_aux", "auto_map",
    "quantization_config", "mlp_bias", "head_dim",
}


def _mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


class DeepSeekV3StateDictAdapter(HFStateDictAdapter):
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    model_cls = DeepSeekV3
    also_reads = ("deepseek_v2",)
    # Exported in fp32 whatever the export dtype (HF keeps the routing bias in fp32 too).
    fp32_hf_suffixes = ("mlp.gate.e_score_correction_bias",)

    def __init__(self, args: DeepSeekV3Args, hf_cfg: dict[str, Any] | None = None):
        super().__init__(args, hf_cfg)
        cfg = hf_cfg or {}
        # Our exports are written interleaved (DeepSeek's own layout), like the published checkpoints.
        self.interleaved = bool(cfg.get("rope_interleave", True))
        self.tied = bool(cfg.get("tie_word_embeddings", False))

    # ---- names ----
    def _rope_rows(self, hf_key: str, n_rows: int, groups) -> Recipe:
        if not self.interleaved:
            return Same(hf_key)
        return RowPermuted(hf_key, half_rope_rows_perm(n_rows, groups))

    def _mtp_copies(self, name: str) -> list[str]:
        return [f"model.layers.{self.args.n_layers + k}.{name}" for k in range(self.args.mtp_depth)]

    def recipe_for(self, key: str) -> Recipe:
        a: DeepSeekV3Args = self.args
        if key == "output.weight" and self.tied:
            return Same("model.embed_tokens.weight")
        if key in ("tok_embeddings.weight", "output.weight") and a.mtp_depth:
            # MTP layers share them; the hub layout stores a copy in each MTP layer.
            copy = "embed_tokens.weight" if key == "tok_embeddings.weight" else "shared_head.head.weight"
            return SameWithCopies(_TOP_RENAMES[key], self._mtp_copies(copy))
        if key in _TOP_RENAMES:
            return Same(_TOP_RENAMES[key])
        m = re.match(r"^mtp\.(\d+)\.(.+)$", key)
        if m is not None:
            prefix, rest = f"model.layers.{a.n_layers + int(m.group(1))}.", m.group(2)
            if rest in _MTP_RENAMES:
                return Same(prefix + _MTP_RENAMES[rest])
            if rest.startswith("block."):
                return self._layer_recipe(a.n_layers + int(m.group(1)), rest.removeprefix("block."), key)
            raise HFConfigError(f"hf error: deepseek_v3: no HF name for native key {key!r}")
        m = re.match(r"^layers\.(\d+)\.(.+)$", key)
        if m is None:
            raise HFConfigError(f"hf error: deepseek_v3: no HF name for native key {key!r}")
        return self._layer_recipe(int(m.group(1)), m.group(2), key)

    def _layer_recipe(self, i: int, rest: str, key: str) -> Recipe:
        """The recipe of `rest` (a block's own key) in HF layer i (a decoder or an MTP layer)."""
        a: DeepSeekV3Args = self.args
        prefix = f"model.layers.{i}."
        if rest in _LAYER_RENAMES:
            return Same(prefix + _LAYER_RENAMES[rest])
        if rest in ("attention.wq.weight", "attention.wq_b.weight"):
            name = "q_proj" if rest == "attention.wq.weight" else "q_b_proj"
            qk = a.qk_head_dim
            groups = [(h * qk + a.qk_nope_head_dim, a.qk_rope_head_dim) for h in range(a.n_heads)]
            return self._rope_rows(f"{prefix}self_attn.{name}.weight", a.n_heads * qk, groups)
        if rest == "attention.wkv_a.weight":
            return self._rope_rows(f"{prefix}self_attn.kv_a_proj_with_mqa.weight",
                                   a.kv_lora_rank + a.qk_rope_head_dim, [(a.kv_lora_rank, a.qk_rope_head_dim)])
        em = re.match(r"^moe\.experts\.(w[123])$", rest)
        if em:
            proj = _EXPERT_RENAMES[em.group(1)]
            return StackedTransposed([f"{prefix}mlp.experts.{e}.{proj}.weight" for e in range(a.n_routed_experts)])
        raise HFConfigError(f"hf error: deepseek_v3: no HF name for native key {key!r}")

    def is_ignored_hf_key(self, key: str) -> bool:
        if super().is_ignored_hf_key(key) or (self.tied and key == "lm_head.weight"):
            return True
        i = layer_index(key)
        if i is not None and i >= self.args.n_layers:
            if i >= self.args.n_layers + self.args.mtp_depth:
                return True  # MTP layers beyond model.mtp_depth: not part of this model
            # The copies of the shared embedding / head in an MTP layer (we use the main ones).
            return key.endswith((".embed_tokens.weight", ".shared_head.head.weight"))
        return self.args.n_shared_experts == 0 and ".mlp.shared_experts." in key

    @classmethod
    def hf_mtp_layers(cls, cfg: dict[str, Any]) -> int:
        return int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0)

    # ---- config ----
    @classmethod
    def for_args(cls, args: DeepSeekV3Args, hf_cfg: dict[str, Any] | None = None) -> "DeepSeekV3StateDictAdapter":
        """DeepSeek V2's format for softmax routing (an HF deepseek_v2 folder, or an export of
        a softmax-routed model: HF DeepseekV3 routes with sigmoid only); V3's otherwise."""
        model_type = (hf_cfg or {}).get("model_type")
        if model_type == "deepseek_v2" or (model_type is None and args.score_func == "softmax"):
            return DeepSeekV2StateDictAdapter(args, hf_cfg)
        return DeepSeekV3StateDictAdapter(args, hf_cfg)

    @classmethod
    def args_from_hf(cls, cfg: dict[str, Any]) -> DeepSeekV3Args:
        if cfg.get("model_type") == "deepseek_v2":
            return DeepSeekV2StateDictAdapter.args_from_hf(cfg)
        where = "deepseek_v3 config.json"
        require(cfg.get("model_type", "deepseek_v3") == "deepseek_v3",
                f"{where}: model_type {cfg.get('model_type')!r} is not 'deepseek_v3'")
        require(cfg.get("scoring_func", "sigmoid") == "sigmoid",
                f"{where}: scoring_func {cfg.get('scoring_func')!r} is not supported (HF DeepseekV3 routes "
                "with sigmoid; softmax routing is DeepSeek V2's model_type)")
        require(cfg.get("topk_method", "noaux_tc") == "noaux_tc",
                f"{where}: topk_method {cfg.get('topk_method')!r} is not supported (only noaux_tc)")
        return cls._parse(cfg, where, score_func="sigmoid", route_norm=bool(cfg.get("norm_topk_prob", True)))

    @classmethod
    def _parse(cls, cfg: dict[str, Any], where: str, *, score_func: str, route_norm: bool) -> DeepSeekV3Args:
        """The config fields DeepSeek V2 and V3 share (MLA, YaRN, MoE shape) -> args."""
        fp8_block_size(cfg, where)  # FP8 block-quantized weights are dequantized by the reader; others refused
        check_known_fields(cfg, _KNOWN_FIELDS, where)
        require(cfg.get("hidden_act", "silu") == "silu", f"{where}: hidden_act {cfg.get('hidden_act')!r} != 'silu'")
        require(not cfg.get("attention_bias", False), f"{where}: attention_bias=true is not supported")
        require(not cfg.get("attention_dropout", 0.0), f"{where}: attention_dropout must be 0")
        require(cfg.get("moe_layer_freq", 1) == 1, f"{where}: moe_layer_freq {cfg.get('moe_layer_freq')} != 1")
        require(not cfg.get("mlp_bias", False), f"{where}: mlp_bias=true is not supported")
        nope, rope_dim = int(cfg.get("qk_nope_head_dim", 128)), int(cfg.get("qk_rope_head_dim", 64))
        require(cfg.get("qk_head_dim") in (None, nope + rope_dim),
                f"{where}: qk_head_dim {cfg.get('qk_head_dim')} != qk_nope_head_dim + qk_rope_head_dim")

        rope = parse_rope(cfg, ("default", "yarn"), 10000.0, where)
        factor, original, beta_fast, beta_slow, mscale = 1.0, 4096, 32.0, 1.0, 1.0
        if rope["rope_type"] == "yarn":
            original = int(rope["original_max_position_embeddings"])
            factor = rope.get("factor")
            factor = float(cfg["max_position_embeddings"] / original if factor is None else factor)
            require(factor >= 1.0, f"{where}: yarn factor {factor} < 1 is not supported")
            require(rope.get("truncate", True), f"{where}: yarn truncate=false is not supported")
            m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
            cos_sin_scale = rope.get("attention_factor")
            if cos_sin_scale is None:
                cos_sin_scale = _mscale(factor, m) / _mscale(factor, m_all) if (m and m_all) else _mscale(factor)
            require(abs(cos_sin_scale - 1.0) < 1e-9,
                    f"{where}: yarn scales cos/sin by {cos_sin_scale:.6g} (mscale {m} vs mscale_all_dim {m_all}); "
                    "only mscale == mscale_all_dim is supported")
            # HF scales the softmax by mscale(factor, mscale_all_dim)^2; ours by mscale(factor, mscale)^2.
            mscale = float(m_all or 0.0)
            beta_fast, beta_slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)

        q_lora = cfg.get("q_lora_rank")
        n_group = int(cfg.get("n_group") or 1)
        args = DeepSeekV3Args(
            vocab_size=int(cfg["vocab_size"]), dim=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
            inter_dim=int(cfg["intermediate_size"]), n_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
            moe_inter_dim=int(cfg["moe_intermediate_size"]), n_routed_experts=int(cfg["n_routed_experts"]),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            n_activated_experts=int(cfg["num_experts_per_tok"]), n_expert_groups=n_group,
            n_limited_groups=int(cfg.get("topk_group") or 1) if n_group > 1 else 1,
            score_func=score_func, route_scale=float(cfg.get("routed_scaling_factor", 1.0)), route_norm=route_norm,
            n_heads=int(cfg["num_attention_heads"]), q_lora_rank=int(q_lora or 0),
            kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
            v_head_dim=int(cfg.get("v_head_dim", 128)), rope_theta=float(rope["rope_theta"]), rope_factor=factor,
            original_seq_len=original, beta_fast=beta_fast, beta_slow=beta_slow, mscale=mscale,
        )
        for flavor in DEEPSEEK_V3_FLAVORS.values():
            if cls.signature(flavor) == cls.signature(args):
                import dataclasses

                return dataclasses.replace(flavor, max_seq_len=args.max_seq_len)
        return args

    def _shared_hf_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """config.json fields DeepSeek V2 and V3 write alike."""
        a: DeepSeekV3Args = self.args
        rope_scaling = None
        if a.yarn_enabled:
            rope_scaling = {"rope_type": "yarn", "factor": a.rope_factor,
                            "original_max_position_embeddings": a.original_seq_len, "beta_fast": a.beta_fast,
                            "beta_slow": a.beta_slow, "mscale": a.mscale, "mscale_all_dim": a.mscale}
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": a.vocab_size, "hidden_size": a.dim, "intermediate_size": a.inter_dim,
            "moe_intermediate_size": a.moe_inter_dim, "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_heads,
            "n_shared_experts": a.n_shared_experts, "n_routed_experts": a.n_routed_experts,
            "routed_scaling_factor": a.route_scale, "kv_lora_rank": a.kv_lora_rank,
            "q_lora_rank": a.q_lora_rank or None, "qk_rope_head_dim": a.qk_rope_head_dim,
            "qk_nope_head_dim": a.qk_nope_head_dim, "v_head_dim": a.v_head_dim,
            "num_experts_per_tok": a.n_activated_experts, "first_k_dense_replace": a.n_dense_layers,
            "hidden_act": "silu", "max_position_embeddings": a.max_seq_len, "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta, "rope_scaling": rope_scaling,
            "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
            "initializer_range": 0.02, "use_cache": True, "torch_dtype": dtype_name(dtype),
        }

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        a: DeepSeekV3Args = self.args
        if a.score_func != "sigmoid":
            raise HFConfigError("hf error: deepseek_v3: HF DeepseekV3 routes with sigmoid; a softmax-routed model "
                                f"(score_func={a.score_func!r}) is exported as deepseek_v2")
        route_norm = a.score_func == "sigmoid" if a.route_norm is None else a.route_norm
        return {**self._shared_hf_config(dtype), "n_group": a.n_expert_groups, "topk_group": a.n_limited_groups,
                "norm_topk_prob": route_norm, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                "rope_interleave": True, "num_nextn_predict_layers": a.mtp_depth}

    @staticmethod
    def signature(a: DeepSeekV3Args) -> dict[str, Any]:
        yarn = a.rope_factor > 1.0
        return {
            "vocab_size": a.vocab_size, "dim": a.dim, "n_layers": a.n_layers, "norm_eps": a.norm_eps,
            "inter_dim": a.inter_dim, "n_dense_layers": a.n_dense_layers, "moe_inter_dim": a.moe_inter_dim,
            "n_routed_experts": a.n_routed_experts, "n_shared_experts": a.n_shared_experts,
            "n_activated_experts": a.n_activated_experts, "n_expert_groups": a.n_expert_groups,
            "n_limited_groups": a.n_limited_groups if a.n_expert_groups > 1 else 1, "score_func": a.score_func,
            "route_scale": a.route_scale,
            "route_norm": a.score_func == "sigmoid" if a.route_norm is None else a.route_norm,
            "n_heads": a.n_heads, "q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim, "rope_theta": a.rope_theta, "rope_factor": a.rope_factor if yarn else 1.0,
            "original_seq_len": a.original_seq_len if yarn else None, "beta_fast": a.beta_fast if yarn else None,
            "beta_slow": a.beta_slow if yarn else None, "mscale": a.mscale if yarn else None,
        }


class DeepSeekV2StateDictAdapter(DeepSeekV3StateDictAdapter):
    """HF `DeepseekV2ForCausalLM`: the same names and layouts (MLA with interleaved RoPE,
    per-expert weights), softmax routing (`topk_method` greedy, or group_limited_greedy
    with a group's score its best expert's), routing weights never renormalised (HF's
    V2 router ignores `norm_topk_prob`), no routing bias and no MTP layers. Our softmax
    models (the `16B` flavor, DeepSeek-V2-Lite's shape) export to it. `expert_bias` loads
    as zeros; a model whose bias moved (aux-loss-free balancing on) cannot be exported."""

    model_type = "deepseek_v2"
    architecture = "DeepseekV2ForCausalLM"
    fp32_hf_suffixes = ()

    def recipe_for(self, key: str) -> Recipe:
        if key.endswith("moe.expert_bias"):
            return Absent()
        return super().recipe_for(key)

    @classmethod
    def args_from_hf(cls, cfg: dict[str, Any]) -> DeepSeekV3Args:
        where = "deepseek_v2 config.json"
        require(cfg.get("scoring_func", "softmax") == "softmax",
                f"{where}: scoring_func {cfg.get('scoring_func')!r} is not supported (HF DeepseekV2 routes with "
                "softmax)")
        method = cfg.get("topk_method", "greedy")
        require(method in ("greedy", "group_limited_greedy"),
                f"{where}: topk_method {method!r} is not supported (greedy or group_limited_greedy)")
        require(not cls.hf_mtp_layers(cfg), f"{where}: DeepSeek V2 has no multi-token-prediction layers")
        if method == "greedy":
            cfg = {**cfg, "n_group": 1, "topk_group": 1}
        return cls._parse(cfg, where, score_func="softmax", route_norm=False)

    def export_problem(self, trained: bool = False) -> str | None:
        a: DeepSeekV3Args = self.args
        if a.mtp_depth:
            return "DeepSeek V2 (the HF model_type of softmax routing) has no multi-token prediction"
        route_norm = a.score_func == "sigmoid" if a.route_norm is None else a.route_norm
        if route_norm:
            return "DeepSeek V2 never renormalises the routing weights (route_norm must be off)"
        if trained and a.load_balance_coeff > 0:
            return ("DeepSeek V2 (the HF model_type of softmax routing) has no routing bias, and aux-loss-free "
                    "balancing would train one; set --moe.bias_update_rate 0 (balance with --moe.aux_loss_coeff)")
        return None

    def check_exportable(self, sd: dict[str, torch.Tensor]) -> str | None:
        moved = sorted(k for k, v in sd.items() if k.endswith("moe.expert_bias") and bool(v.abs().max() > 0))
        if moved:
            return (f"hf error: deepseek_v2: {len(moved)} routing bias(es) are non-zero (e.g. {moved[0]}): DeepSeek "
                    "V2 routes without one; train with --moe.bias_update_rate 0 to export it")
        return None

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        problem = self.export_problem()
        if problem:
            raise HFConfigError(f"hf error: deepseek_v2: cannot export this model: {problem}")
        a: DeepSeekV3Args = self.args
        grouped = a.n_expert_groups > 1
        return {**self._shared_hf_config(dtype), "n_group": a.n_expert_groups if grouped else None,
                "topk_group": a.n_limited_groups if grouped else None,
                "topk_method": "group_limited_greedy" if grouped else "greedy", "scoring_func": "softmax",
                "norm_topk_prob": False}
