"""Hugging Face interop building blocks shared by the per-model state-dict adapters.

Two things live here:

* config.json parsing: `read_hf_config`, `parse_rope` (both the current format,
  RoPE in `rope_parameters`, and the legacy one, `rope_theta` + `rope_scaling`),
  and `check_known_fields`, which turns any field we do not understand into one
  clear line instead of a silently different model.
* Weight recipes: how one native tensor is made of Hugging Face tensors. A recipe
  can build any rectangular *region* of the native tensor, reading only the HF
  bytes that region needs; that is what lets every rank of a sharded model read
  just its own shard (trainer/hf_io.py), and what `to_hf` / `from_hf` use on
  whole tensors.

Each model adds a `HFStateDictAdapter` subclass (models/<name>/state_dict_adapter.py)
that maps native names to recipes and model args to/from an HF config.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable

import torch


class HFConfigError(ValueError):
    """An HF config.json (or state dict) this repo cannot represent exactly; one line."""


# Fields every PreTrainedConfig may carry that do not change the math of a forward pass.
GENERIC_HF_FIELDS = frozenset({
    "architectures", "model_type", "_name_or_path", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "use_cache", "initializer_range", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "cross_attention_hidden_size", "add_cross_attention",
    "tie_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class", "prefix",
    "task_specific_params", "finetuning_task", "_attn_implementation_autoset", "_commit_hash",
    "pretraining_tp", "output_router_logits", "router_aux_loss_coef", "generation_config",
})

# Keys allowed inside a RoPE dict, per rope type ("type" is the legacy spelling of "rope_type").
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
    "yarn": {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"},
}


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise HFConfigError(f"hf error: {path} not found; an HF model folder needs its config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFConfigError(f"hf error: {path} is not valid JSON ({e.msg} at line {e.lineno})") from None


def spec_for_hf_config(cfg: dict[str, Any], where: str = "config.json"):
    """The ModelSpec whose HF adapter reads `cfg`'s model_type (one line when none does)."""
    from models import MODEL_SPECS

    model_type = cfg.get("model_type")
    for spec in MODEL_SPECS.values():
        if spec.state_dict_adapter is not None and model_type in spec.state_dict_adapter.reads_model_types():
            return spec
    known = sorted(t for s in MODEL_SPECS.values() if s.state_dict_adapter
                   for t in s.state_dict_adapter.reads_model_types())
    raise HFConfigError(f"hf error: {where}: model_type {model_type!r} is not supported (supported: {known})")


def model_from_hf_folder(folder: str | Path) -> tuple[str, Any]:
    """(model spec name, model args) that an HF folder's config.json describes: what
    `--model.hf_path` builds (trainer/model_args.py applies the config overrides)."""
    cfg = read_hf_config(folder)
    spec = spec_for_hf_config(cfg, f"{Path(folder) / 'config.json'}")
    return spec.name, spec.state_dict_adapter.args_from_hf(cfg)


def matching_flavors(spec, args) -> list[str]:
    """Flavors of `spec` with the same shape and math as `args` (by the adapter's signature)."""
    sig = spec.state_dict_adapter.signature
    return [name for name, a in spec.flavors.items() if sig(a) == sig(args)]


FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def fp8_block_size(cfg: dict[str, Any], where: str) -> tuple[int, int] | None:
    """The weight block of an FP8 block-quantized checkpoint (DeepSeek V3's
    `quantization_config`: quant_method fp8, weight_block_size [128, 128]); None when the
    folder is not quantized. Any other quantization is refused in one line."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    require(isinstance(q, dict), f"{where}: quantization_config must be a dict")
    method = q.get("quant_method")
    block = q.get("weight_block_size")
    if method != "fp8" or not (isinstance(block, list) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise HFConfigError(f"hf error: {where}: quantization {method!r} (weight_block_size {block}) is not "
                            "supported; only FP8 block-quantized weights (quant_method fp8 with a 2-D "
                            "weight_block_size) are dequantized on import")
    require(q.get("fmt", "e4m3") == "e4m3", f"{where}: FP8 format {q.get('fmt')!r} is not supported (only e4m3)")
    return int(block[0]), int(block[1])


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, region: tuple[slice, slice],
                         block: tuple[int, int]) -> torch.Tensor:
    """fp32 `weight * scale` for the rows/cols `region` of a block-quantized tensor.

    `weight` is that region of the FP8 tensor; `scale_inv` holds the scales of the blocks
    the region touches, starting at block (region rows.start // br, cols.start // bc).
    Blocks at the right / bottom edge may be partial: their scale covers what is there."""
    (rows, cols), (br, bc) = region, block
    r = torch.arange(rows.start, rows.stop) // br - rows.start // br
    c = torch.arange(cols.start, cols.stop) // bc - cols.start // bc
    return weight.to(torch.float32) * scale_inv.to(torch.float32)[r][:, c]


def check_known_fields(cfg: dict[str, Any], known: Iterable[str], where: str) -> None:
    """Raises one line naming every field of `cfg` that is neither in `known` nor generic."""
    unknown = sorted(set(cfg) - set(known) - GENERIC_HF_FIELDS)
    if unknown:
        raise HFConfigError(f"hf error: {where}: unsupported config field(s) {unknown}; this repo cannot "
                            "represent them, so the converted model would differ")


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise HFConfigError(f"hf error: {msg}")


def parse_rope(cfg: dict[str, Any], supported: Iterable[str], default_theta: float, where: str) -> dict[str, Any]:
    """The RoPE settings of an HF config as one flat dict with `rope_type` and `rope_theta`.

    Reads the current format (`rope_parameters`, which holds `rope_theta`) and the
    legacy one (top-level `rope_theta`, optional `rope_scaling` dict with `type` or
    `rope_type`). Unsupported rope types or fields raise one line."""
    params = cfg.get("rope_parameters")
    if params is not None:
        require(isinstance(params, dict), f"{where}: rope_parameters must be a dict")
        if params and all(isinstance(v, dict) for v in params.values()):
            raise HFConfigError(f"hf error: {where}: per-layer-type rope_parameters ({sorted(params)}) are not "
                                "supported")
        rope = dict(params)
        if "rope_theta" not in rope and "rope_theta" in cfg:
            rope["rope_theta"] = cfg["rope_theta"]
    else:
        scaling = cfg.get("rope_scaling") or {}
        require(isinstance(scaling, dict), f"{where}: rope_scaling must be a dict or null")
        rope = dict(scaling)
        rope["rope_theta"] = cfg.get("rope_theta", default_theta)
    rope_type = rope.pop("type", None) or rope.get("rope_type") or "default"
    rope["rope_type"] = rope_type
    if rope_type not in supported:
        raise HFConfigError(f"hf error: {where}: rope type {rope_type!r} is not supported (supported: "
                            f"{sorted(supported)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFConfigError(f"hf error: {where}: partial_rotary_factor {rope['partial_rotary_factor']} is not "
                            "supported")
    rope.pop("partial_rotary_factor", None)
    unknown = sorted(set(rope) - _ROPE_KEYS[rope_type])
    if unknown:
        raise HFConfigError(f"hf error: {where}: unsupported {rope_type} rope field(s) {unknown}")
    return rope


# --------------------------------------------------------------------------- recipes

Region = tuple[slice, ...]
# (hf key, slices into that HF tensor) -> the tensor block.
Getter = Callable[[str, Region], torch.Tensor]


def full_region(shape: Iterable[int]) -> Region:
    return tuple(slice(0, int(n)) for n in shape)


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in region)


class Recipe:
    """How one native tensor is made from HF tensors."""

    hf_keys: list[str]

    def hf_shapes(self, native_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def load(self, get: Getter, region: Region) -> torch.Tensor:
        """The native tensor's `region`, reading only what it needs through `get`."""
        raise NotImplementedError

    def to_hf(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """The HF tensors of a whole native tensor."""
        raise NotImplementedError


# Names every decoder family here shares with transformers' `*ForCausalLM` (literal tables,
# so an adapter's map reads top to bottom): the edges of the model, and a SwiGLU expert's
# projections (`experts.{e}.{gate,down,up}_proj`).
HF_TOP_RENAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
HF_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


class Same(Recipe):
    """native == hf (same shape, same layout)."""

    def __init__(self, hf_key: str):
        self.hf_keys = [hf_key]

    def hf_shapes(self, native_shape):
        return {self.hf_keys[0]: tuple(native_shape)}

    def load(self, get, region):
        return get(self.hf_keys[0], region)

    def to_hf(self, t):
        return {self.hf_keys[0]: t}


class SameWithCopies(Same):
    """native == hf_key; the export also writes identical copies under `copies` (DeepSeek
    MTP layers store the shared embedding and head again). Import reads only hf_key."""

    def __init__(self, hf_key: str, copies: Iterable[str]):
        super().__init__(hf_key)
        self.copies = list(copies)

    def to_hf(self, t):
        return {k: t for k in [self.hf_keys[0], *self.copies]}


class Tied(Same):
    """native == hf_key, a tensor this model ties to another (Qwen3's output head is the
    embedding, `tie_word_embeddings`): it loads from hf_key and exports nothing, since the
    tensor it is tied to writes hf_key already."""

    def to_hf(self, t):
        return {}


class Absent(Recipe):
    """A native tensor this HF format does not store (DeepSeek V2 has no routing bias): it
    loads as zeros, and exports nothing (the adapter's `check_exportable` refuses a
    non-zero one)."""

    hf_keys: list[str] = []

    def hf_shapes(self, native_shape):
        return {}

    def load(self, get, region):
        return torch.zeros(region_shape(region))

    def to_hf(self, t):
        return {}


class RowPermuted(Recipe):
    """native[i] = hf[perm[i]] along dim 0 (e.g. interleaved -> rotate-half RoPE rows)."""

    def __init__(self, hf_key: str, perm: torch.Tensor):
        self.hf_keys = [hf_key]
        self.perm = perm.long()
        self.inverse = torch.empty_like(self.perm)
        self.inverse[self.perm] = torch.arange(self.perm.numel())

    def hf_shapes(self, native_shape):
        return {self.hf_keys[0]: tuple(native_shape)}

    def load(self, get, region):
        rows = self.perm[region[0]]
        lo, hi = int(rows.min()), int(rows.max()) + 1
        block = get(self.hf_keys[0], (slice(lo, hi),) + tuple(region[1:]))
        return block.index_select(0, rows - lo)

    def to_hf(self, t):
        return {self.hf_keys[0]: t.index_select(0, self.inverse.to(t.device))}


class StackedTransposed(Recipe):
    """native[e] = hf_keys[e].T: E per-expert [B, A] linear weights as one [E, A, B] tensor."""

    def __init__(self, hf_keys: list[str]):
        self.hf_keys = list(hf_keys)

    def hf_shapes(self, native_shape):
        _, a, b = native_shape
        return {k: (b, a) for k in self.hf_keys}

    def load(self, get, region):
        experts, rows, cols = region
        blocks = [get(self.hf_keys[e], (cols, rows)).t() for e in range(experts.start, experts.stop)]
        if not blocks:
            raise ValueError("empty expert region")
        return torch.stack(blocks)

    def to_hf(self, t):
        return {k: t[e].t().contiguous() for e, k in enumerate(self.hf_keys)}


def half_rope_rows_perm(n_rows: int, groups: Iterable[tuple[int, int]]) -> torch.Tensor:
    """Row permutation that turns each interleaved-RoPE group (start, size) of an
    n_rows output into the rotate-half layout (pairs (2i, 2i+1) -> (i, i + size/2)),
    leaving every other row in place: native = hf[perm]."""
    perm = torch.arange(n_rows)
    for start, size in groups:
        sub = torch.cat([torch.arange(0, size, 2), torch.arange(1, size, 2)])
        perm[start:start + size] = start + sub
    return perm


# --------------------------------------------------------------------------- adapter base


class HFStateDictAdapter:
    """Native <-> HF names and layouts for one model, plus model args <-> HF config.

    Subclasses set `model_type` / `architecture` and implement `recipe_for`,
    `args_from_hf`, `hf_config` and `signature`. `hf_cfg` is the config of the HF
    checkpoint being read (it may change layouts, e.g. `rope_interleave`); None means
    our own export format.
    """

    model_type: str = ""
    architecture: str = ""
    model_cls: Callable[[Any], torch.nn.Module]
    # Other HF model_types this adapter (or a subclass it picks) reads, e.g. deepseek_v2.
    also_reads: tuple[str, ...] = ()

    @classmethod
    def reads_model_types(cls) -> tuple[str, ...]:
        return (cls.model_type, *cls.also_reads)

    @classmethod
    def for_args(cls, args: Any, hf_cfg: dict[str, Any] | None = None) -> "HFStateDictAdapter":
        """The adapter for these args and (when importing) this HF config; a subclass may
        pick another HF architecture here (DeepSeek: softmax routing is DeepSeek V2)."""
        return cls(args, hf_cfg)

    @classmethod
    def hf_mtp_layers(cls, cfg: dict[str, Any]) -> int:
        """Multi-token-prediction layers stored in a folder with this config.json."""
        return 0

    def check_exportable(self, sd: dict[str, torch.Tensor]) -> str | None:
        """Why (some of) these native tensors cannot be written in this HF format, or None."""
        return None

    def export_problem(self, trained: bool = False) -> str | None:
        """Why a model with these args could not be written in this HF format, or None;
        `trained`: also what training it would break (checked at config time when
        `checkpoint.last_save_in_hf` is set, before any step runs)."""
        return None

    def __init__(self, args: Any, hf_cfg: dict[str, Any] | None = None):
        self.args = args
        self.hf_cfg = hf_cfg
        self._recipes: dict[str, Recipe] | None = None
        self._shapes: dict[str, tuple[int, ...]] | None = None

    # ---- per model ----
    @classmethod
    def args_from_hf(cls, cfg: dict[str, Any]) -> Any:
        raise NotImplementedError

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def signature(args: Any) -> dict[str, Any]:
        """The args that decide the weights' shapes and the forward math (not max_seq_len, init, ...)."""
        raise NotImplementedError

    def recipe_for(self, key: str) -> Recipe:
        raise NotImplementedError

    def is_ignored_hf_key(self, key: str) -> bool:
        """HF keys that may be present but that we drop (rotary inv_freq buffers; FP8 block
        scales, which the reader applies to their weights)."""
        return key.endswith(("rotary_emb.inv_freq", "_scale_inv"))

    # ---- generic ----
    def native_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every native state-dict key of the full (unsplit) model and its shape."""
        if self._shapes is None:
            with torch.device("meta"):
                model = self.model_cls(self.args)
            self._shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        return self._shapes

    def recipes(self) -> dict[str, Recipe]:
        if self._recipes is None:
            self._recipes = {k: self.recipe_for(k) for k in self.native_shapes()}
        return self._recipes

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        shapes = self.native_shapes()
        for k, r in self.recipes().items():
            out.update(r.hf_shapes(shapes[k]))
        return out

    def check_hf_keys(self, hf_shapes: dict[str, tuple[int, ...]], source: str) -> None:
        """One error listing missing keys, unexpected keys and shape mismatches, if any."""
        expected = self.expected_hf_shapes()
        missing = sorted(set(expected) - set(hf_shapes))
        unexpected = sorted(k for k in set(hf_shapes) - set(expected) if not self.is_ignored_hf_key(k))
        wrong = sorted(f"{k} {tuple(hf_shapes[k])} != {expected[k]}" for k in set(expected) & set(hf_shapes)
                       if tuple(hf_shapes[k]) != tuple(expected[k]))
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s): {_clip(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s): {_clip(unexpected)}")
        if wrong:
            parts.append(f"{len(wrong)} shape mismatch(es): {_clip(wrong)}")
        if parts:
            raise HFConfigError(f"hf error: {source} does not match {type(self).__name__.replace('Adapter', '')} "
                                f"({'; '.join(parts)})")

    def to_hf(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Native (whole tensors) -> HF names and layouts. Keys without a recipe raise."""
        recipes = self.recipes()
        out: dict[str, torch.Tensor] = {}
        for k, v in sd.items():
            if k not in recipes:
                raise HFConfigError(f"hf error: no HF name for native key {k!r}")
            out.update(recipes[k].to_hf(v))
        return out

    def from_hf(self, hf_sd: dict[str, torch.Tensor], strict: bool = True) -> dict[str, torch.Tensor]:
        """HF (whole tensors) -> native names and layouts. With `strict`, missing or
        unexpected keys raise one error listing them."""
        if strict:
            self.check_hf_keys({k: tuple(v.shape) for k, v in hf_sd.items()}, "state dict")
        shapes = self.native_shapes()
        get = lambda key, region: hf_sd[key][region]  # noqa: E731
        return {k: r.load(get, full_region(shapes[k])) for k, r in self.recipes().items()
                if all(h in hf_sd for h in r.hf_keys)}

    def mismatches(self, other_args: Any) -> list[str]:
        """Fields where `other_args` differs from this adapter's args (by `signature`)."""
        a, b = self.signature(self.args), self.signature(other_args)
        return [f"{k}: {b[k]!r} != {a[k]!r}" for k in a if a[k] != b.get(k)]


def _clip(items: list[str], n: int = 8) -> str:
    shown = ", ".join(items[:n])
    return shown + (f", ... (+{len(items) - n} more)" if len(items) > n else "")


def layer_index(key: str) -> int | None:
    m = re.match(r"^(?:model\.)?layers\.(\d+)\.", key)
    return int(m.group(1)) if m else None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
