"""Builders of small random transformers models saved as HF folders (no hub), and helpers that
load them: shared by the HF interop tests (test_hf_models, test_hf_scripts, test_hf_train,
test_moe_balance, test_mtp, test_qwen3_models). Weights are chosen so that RoPE and routing
matter: q/k weights large enough for peaked attention, non-unit norm gains, random routing
biases, one expert that never receives a token."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from trainer.hf_io import args_from_hf_folder, load_hf_into_model


def _make_weights_matter(model, qk_names: tuple[str, ...], seed: int) -> None:
    """Re-initialises an HF model so that a wrong layout cannot hide: unit-variance
    embeddings, 1/sqrt(fan_in) linears (2x for q/k producers: attention logits of
    std ~4, so RoPE decides where a token looks), norm gains 1 +- 0.3, random routing
    biases with expert 3 pushed out of every top-k."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                gain = 2.0 if any(q in name for q in qk_names) else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * gain / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
                b[3] = -100.0


def _legacy_rope(folder: Path) -> None:
    """Rewrites config.json with the legacy RoPE spelling (rope_theta + rope_scaling)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    if "rope_parameters" not in cfg:  # transformers < 5 writes the legacy spelling already
        return
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type", "default")
    cfg["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    path.write_text(json.dumps(cfg, indent=2))


def build_hf_tokenizer(folder: Path, vocab: int, *, bos: str = "<|begin_of_text|>",
                       eos: str = "<|end_of_text|>") -> Path:
    """A real byte-level BPE `tokenizer.json` of `vocab` - 8 ids (so that it fits a model of
    `vocab`), trained with the `tokenizers` library on a slice of the builtin corpus, plus
    the tokenizer_config.json naming its BOS / EOS (as HF folders have)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from trainer.data.builtin_corpus import builtin_documents

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [bos, eos, "<|pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab - 8, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(builtin_documents(max_files=40), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "pad_token": "<|pad|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def build_hf_llama(folder: Path, *, gqa: bool = True, rope_scaling: bool = True, tied: bool = False,
                   legacy: bool = False, vocab: int = 256, layers: int = 2, seed: int = 0,
                   tokenizer: bool = False) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    # Legacy kwargs (rope_theta + rope_scaling) work in every transformers release; v5 saves them
    # in the current format (rope_parameters). Original context 16: the llama3 scaling touches
    # most frequencies at these lengths.
    scaling = None
    if rope_scaling:
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2 if gqa else 4, rms_norm_eps=1e-5,
                      max_position_embeddings=256, rope_theta=500000.0 if rope_scaling else 10000.0,
                      rope_scaling=scaling, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    save_random_gqa_folder(LlamaForCausalLM(cfg), folder, seed=seed, tied=tied, legacy=legacy)
    if tokenizer:
        build_hf_tokenizer(folder, vocab)
    return folder


def save_random_gqa_folder(model, folder: Path, *, seed: int, tied: bool, legacy: bool) -> None:
    """Randomises a q_proj / k_proj model (`_make_weights_matter`), ties its head if asked, saves
    it with transformers, and rewrites config.json in the legacy RoPE spelling if asked."""
    _make_weights_matter(model, ("q_proj", "k_proj"), seed)
    if tied:
        model.tie_weights()
    model.save_pretrained(folder)
    if legacy:
        _legacy_rope(folder)


def build_hf_deepseek(folder: Path, *, q_lora: bool = True, yarn: bool = True, legacy: bool = False,
                      vocab: int = 256, seed: int = 0, tokenizer: bool = False) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    scaling = None
    if yarn:
        scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                   "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
    cfg = DeepseekV3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48 if q_lora else None, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6,
        # with q LoRA: grouped sigmoid routing, normalised, scaled; without: 1 group, raw weights, 2 shared experts
        n_group=4 if q_lora else 1, topk_group=2 if q_lora else 1, norm_topk_prob=q_lora,
        routed_scaling_factor=2.5 if q_lora else 1.0, n_shared_experts=1 if q_lora else 2,
        rope_theta=10000.0, rope_scaling=scaling, num_nextn_predict_layers=0)
    folder = _save_random_deepseek(DeepseekV3ForCausalLM, cfg, folder, seed, legacy)
    if tokenizer:
        build_hf_tokenizer(folder, vocab, bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>")
    return folder


def _save_random_deepseek(model_cls, cfg, folder: Path, seed: int, legacy: bool) -> Path:
    torch.manual_seed(seed)
    model = model_cls(cfg)
    _make_weights_matter(model, ("q_proj", "q_b_proj", "kv_a_proj", "kv_b_proj"), seed)
    model.save_pretrained(folder)
    if legacy:
        _legacy_rope(folder)
    return folder


def build_hf_deepseek_v2(folder: Path, *, grouped: bool = False, legacy: bool = False, vocab: int = 256,
                         seed: int = 0) -> Path:
    """A random DeepSeek V2 (softmax routing, no routing bias, YaRN with mscale 0.707 like
    V2-Lite): greedy top-k, or group-limited greedy with `grouped`."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
               "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
    cfg = DeepseekV2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None if not grouped else 48, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6,
        topk_method="group_limited_greedy" if grouped else "greedy", n_group=4 if grouped else None,
        topk_group=2 if grouped else None, routed_scaling_factor=1.5, n_shared_experts=2, norm_topk_prob=False,
        rope_theta=10000.0, rope_scaling=scaling)
    return _save_random_deepseek(DeepseekV2ForCausalLM, cfg, folder, seed, legacy)


def add_hf_mtp_layers(folder: Path, depth: int = 1, seed: int = 5) -> Path:
    """Appends `depth` DeepSeek V3 MTP layers to an HF folder in the hub layout
    (`model.layers.{n_layers + k}.*`: enorm, hnorm, eh_proj, a MoE block, shared_head.norm,
    and copies of the embedding and head), random weights, num_nextn_predict_layers set.
    transformers ignores these layers (it has no MTP)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    sd = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n - 1}."  # a MoE layer: the MTP block has the same keys
    dim = cfg["hidden_size"]
    for k in range(depth):
        p = f"model.layers.{n + k}."
        for key in [x for x in sd if x.startswith(last)]:
            t = sd[key]
            if key.endswith("norm.weight"):
                new = 1 + 0.3 * torch.randn(t.shape, generator=g)
            elif key.endswith("e_score_correction_bias"):
                new = 0.1 * torch.randn(t.shape, generator=g)
            else:
                new = torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1])
            sd[p + key.removeprefix(last)] = new.to(t.dtype)
        for name in ("enorm", "hnorm", "shared_head.norm"):
            sd[f"{p}{name}.weight"] = 1 + 0.3 * torch.randn(dim, generator=g)
        sd[f"{p}eh_proj.weight"] = torch.randn(dim, 2 * dim, generator=g) / math.sqrt(2 * dim)
        sd[f"{p}embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
        sd[f"{p}shared_head.head.weight"] = sd["lm_head.weight"].clone()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = depth
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def is_fp8_weight(key: str, t: torch.Tensor) -> bool:
    """The tensors DeepSeek V3's published checkpoint stores in FP8: every linear weight but
    the embedding, the head and the router."""
    return t.ndim == 2 and not key.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight",
                                             "shared_head.head.weight"))


def reference_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block dequantization written independently of the loader: each scale repeated over
    its block, the repeats cut at the (partial) edges."""
    rows, cols = q.shape
    scale = scale_inv.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return q.to(torch.float32) * scale


def quantize_hf_folder_fp8(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> tuple[Path, Path]:
    """`src` quantized the way DeepSeek V3 ships (float8_e4m3fn weights, one fp32
    `weight_scale_inv` per block, amax / 448), and its twin: the same folder with the
    reference dequantization of those weights in fp32. Returns (fp8 folder, twin)."""
    import shutil

    from safetensors.torch import load_file, save_file

    sd = load_file(str(src / "model.safetensors"))
    fp8, twin = {}, {}
    for k, v in sd.items():
        if not is_fp8_weight(k, v):
            fp8[k] = twin[k] = v
            continue
        rows, cols = v.shape
        nb = (-(-rows // block[0]), -(-cols // block[1]))
        scale = torch.empty(nb, dtype=torch.float32)
        q = torch.empty(v.shape, dtype=torch.float8_e4m3fn)
        for i in range(nb[0]):
            for j in range(nb[1]):
                r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
                scale[i, j] = v[r, c].abs().amax().clamp_min(1e-12) / 448.0
                q[r, c] = (v[r, c] / scale[i, j]).to(torch.float8_e4m3fn)
        fp8[k], fp8[k + "_scale_inv"] = q, scale
        twin[k] = reference_dequantize(q, scale, block)
    cfg = json.loads((src / "config.json").read_text())
    for folder, tensors in ((dst / "fp8", fp8), (dst / "twin", twin)):
        shutil.copytree(src, folder)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    (dst / "fp8" / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}, indent=2))
    return dst / "fp8", dst / "twin"


def load_hf_model(folder: Path):
    """transformers' model in fp32 (`dtype` is `torch_dtype` before transformers 4.56)."""
    import transformers
    from transformers import AutoModelForCausalLM

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(folder, **{key: torch.float32}).eval()


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = load_hf_model(folder)
    with torch.no_grad():
        return model(tokens).logits


def our_model_from_hf(folder: Path):
    spec, args = args_from_hf_folder(folder)
    model = spec.model_cls(args)
    model.init_weights()
    load_hf_into_model([model], folder)
    return model.eval()


def tokens_for(vocab: int, seed: int = 1, shape=(2, 48)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
