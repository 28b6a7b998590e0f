"""HF interop, one process: small random transformers models -> our models -> back.

Every case builds a random HF model locally (no hub), with weights chosen so that
RoPE and routing matter (q/k weights large enough for peaked attention, non-unit
norm gains, random routing biases, one expert that never receives a token), saves
it with `save_pretrained`, loads it into our model and compares logits in fp32;
then exports ours with `save_hf` and reloads that with transformers.

Builders here are also used by tests/test_hf_scripts.py, test_hf_train.py, test_moe_balance.py and test_mtp.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from models.hf_config import HFConfigError  # noqa: E402
from trainer.hf_io import (  # noqa: E402
    HFReader,
    args_from_hf_folder,
    load_hf_into_model,
    load_hf_state_dict,
    save_hf,
    save_hf_state_dict,
)

TOL = 1e-4
# Measured max |diff| per case, printed by `pytest -s` (and kept for the report).
MEASURED: dict[str, float] = {}


# --------------------------------------------------------------------------- builders


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


def _is_fp8_weight(key: str, t: torch.Tensor) -> bool:
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
        if not _is_fp8_weight(k, v):
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


CASES = {
    "llama_gqa_llama3rope": lambda d: build_hf_llama(d, gqa=True, rope_scaling=True),
    "llama_mha_tied_legacycfg": lambda d: build_hf_llama(d, gqa=False, rope_scaling=False, tied=True, legacy=True),
    "deepseek_qlora_yarn": lambda d: build_hf_deepseek(d, q_lora=True, yarn=True),
    "deepseek_noqlora_legacycfg": lambda d: build_hf_deepseek(d, q_lora=False, yarn=True, legacy=True),
    # Softmax routing (our 16B flavor's) lives in HF's DeepSeek V2.
    "deepseek_v2_greedy": lambda d: build_hf_deepseek_v2(d, grouped=False),
    "deepseek_v2_grouped_legacycfg": lambda d: build_hf_deepseek_v2(d, grouped=True, legacy=True),
}


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


# --------------------------------------------------------------------------- parity


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: build(root / name) for name, build in CASES.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_import_export_logits_parity(case, hf_dirs, tmp_path):
    src = hf_dirs[case]
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:  # both config.json spellings are covered
        saved = json.loads((src / "config.json").read_text())
        assert ("rope_parameters" in saved) != case.endswith("legacycfg")
    tokens = tokens_for(256)
    ref = hf_logits(src, tokens)
    model = our_model_from_hf(src)
    with torch.no_grad():
        ours = model(tokens)
    import_diff = (ours - ref).abs().max().item()
    assert ref.std() > 0.5, "logits too flat to test anything"

    if case.startswith("deepseek"):  # routing matters: loads differ (V3: some expert gets nothing)
        was_training = model.training
        model.train()  # expert loads are counted in training forwards only (validation must not feed the bias)
        with torch.no_grad():
            model(tokens)
        model.train(was_training)
        counts = torch.stack([b for n, b in model.named_buffers() if n.endswith("tokens_per_expert")])
        assert (counts > 0).sum() > counts.shape[0] * 2 and counts.float().std(dim=1).min() > 2
        assert (counts == 0).any() or case.startswith("deepseek_v2")

    out = tmp_path / "export"
    save_hf([model], out, dtype=torch.float32)
    back = hf_logits(out, tokens)
    export_diff = (back - ref).abs().max().item()
    MEASURED[case] = max(import_diff, export_diff)
    print(f"\n{case}: import max|diff| {import_diff:.3g}, export->transformers max|diff| {export_diff:.3g}")
    assert import_diff < TOL
    assert export_diff < TOL

    # Export is the exact inverse of import: same tensors as the original HF checkpoint
    # (a tied lm_head is written out explicitly).
    orig, new = HFReader(src), HFReader(out)
    for k in orig.keys():
        assert torch.equal(orig.full(k), new.full(k)), k
    assert set(new.keys()) - set(orig.keys()) <= {"lm_head.weight"}


@pytest.mark.timeout(120)
def test_rope_layout_is_checked(hf_dirs):
    """Negative controls: the wrong RoPE layout must move the logits far beyond TOL."""
    from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
    from models.hf_config import half_rope_rows_perm

    tokens = tokens_for(256)
    # DeepSeek: skipping the interleaved -> rotate-half permutation.
    src = hf_dirs["deepseek_qlora_yarn"]
    ref = hf_logits(src, tokens)
    spec, args, _ = load_hf_state_dict(src)
    cfg = json.loads((src / "config.json").read_text())
    wrong = DeepSeekV3StateDictAdapter(args, {**cfg, "rope_interleave": False})
    reader = HFReader(src)
    sd = wrong.from_hf({k: reader.full(k) for k in reader.keys()})
    model = spec.model_cls(args)
    model.load_state_dict(sd)
    with torch.no_grad():
        assert (model.eval()(tokens) - ref).abs().max() > 100 * TOL

    # Llama: q/k in Meta's interleaved layout instead of HF's rotate-half one.
    src = hf_dirs["llama_gqa_llama3rope"]
    ref = hf_logits(src, tokens)
    spec, args, sd = load_hf_state_dict(src)
    for i in range(args.n_layers):
        for name, heads in (("wq", args.n_heads), ("wk", args.kv_heads)):
            key = f"layers.{i}.attention.{name}.weight"
            hd = args.head_dim
            perm = half_rope_rows_perm(heads * hd, [(h * hd, hd) for h in range(heads)])
            sd[key] = sd[key][perm]
    model = spec.model_cls(args)
    model.load_state_dict(sd)
    with torch.no_grad():
        assert (model.eval()(tokens) - ref).abs().max() > 100 * TOL


@pytest.mark.timeout(120)
def test_export_bf16_and_sharded(hf_dirs, tmp_path):
    """export_dtype=bfloat16 writes bf16 (routing bias stays fp32); small shards give an index."""
    src = hf_dirs["deepseek_qlora_yarn"]
    model = our_model_from_hf(src)
    out = tmp_path / "bf16"
    save_hf([model], out, dtype=torch.bfloat16, max_shard_bytes=64 << 10)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((out / f).is_file() for f in files)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["model_type"] == "deepseek_v3"
    reader = HFReader(out)
    for k in reader.keys():
        want = torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16
        assert reader.full(k).dtype == want, k

    # transformers reads it; its logits equal the fp32 model with bf16-rounded weights.
    tokens = tokens_for(256)
    ref_model = load_hf_model(src)
    with torch.no_grad():
        for n, p in ref_model.named_parameters():
            p.copy_(p.to(torch.bfloat16).float())
        ref = ref_model(tokens).logits
    back = hf_logits(out, tokens)
    assert (back - ref).abs().max().item() < TOL
    # And our sharded reader loads it back into our model.
    model2 = our_model_from_hf(out)
    with torch.no_grad():
        assert (model2(tokens) - ref).abs().max().item() < TOL


# --------------------------------------------------------------------------- config.json


def _llama_cfg(**over):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 256}
    cfg.update(over)
    return cfg


def _ds_cfg(**over):
    cfg = {"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
           "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
           "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 24, "n_group": 4, "topk_group": 2,
           "routed_scaling_factor": 2.5, "n_shared_experts": 1, "max_position_embeddings": 256}
    cfg.update(over)
    return cfg


def test_config_current_and_legacy_rope_agree():
    from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter as DS
    from models.llama3.state_dict_adapter import Llama3StateDictAdapter as L

    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    cur = L.args_from_hf(_llama_cfg(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **llama3}))
    old = L.args_from_hf(_llama_cfg(rope_theta=5e5, rope_scaling={"rope_type": "llama3", **llama3}))
    older = L.args_from_hf(_llama_cfg(rope_theta=5e5, rope_scaling={"type": "llama3", **llama3}))
    assert cur == old == older and cur.rope_scaling.factor == 8.0 and cur.rope_theta == 5e5

    yarn = {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    cur = DS.args_from_hf(_ds_cfg(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, **yarn}))
    old = DS.args_from_hf(_ds_cfg(rope_theta=1e4, rope_scaling={"type": "yarn", **yarn}))
    assert cur == old and cur.rope_factor == 40.0 and cur.original_seq_len == 4096 and cur.mscale == 1.0
    plain = DS.args_from_hf(_ds_cfg(rope_theta=1e4, q_lora_rank=None))
    assert plain.rope_factor == 1.0 and plain.q_lora_rank == 0


@pytest.mark.parametrize("adapter,cfg,needle", [
    ("llama", _llama_cfg(sliding_window=128), "sliding_window"),
    ("llama", _llama_cfg(rope_scaling={"type": "linear", "factor": 2.0}), "'linear'"),
    ("llama", _llama_cfg(rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                       "bogus": 1}), "bogus"),
    ("llama", _llama_cfg(hidden_act="gelu"), "hidden_act"),
    ("llama", _llama_cfg(head_dim=32), "head_dim"),
    ("deepseek", _ds_cfg(scoring_func="softmax"), "scoring_func"),
    ("deepseek", _ds_cfg(rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                       "mscale": 0.707, "mscale_all_dim": 1.0}), "mscale"),
    ("deepseek", _ds_cfg(rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}),
     "cos/sin"),
    ("deepseek", _ds_cfg(quantization_config={"quant_method": "fp8"}), "dequantize"),
    ("deepseek", _ds_cfg(quantization_config={"quant_method": "gptq", "bits": 4}), "'gptq'"),
    ("deepseek", _ds_cfg(quantization_config={"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}),
     "e5m2"),
    ("deepseek", _ds_cfg(model_type="deepseek_v2", scoring_func="sigmoid"), "scoring_func"),
    ("deepseek", _ds_cfg(model_type="deepseek_v2", scoring_func="softmax", num_nextn_predict_layers=1), "multi-token"),
    ("deepseek", _ds_cfg(model_type="qwen2_moe"), "model_type"),
])
def test_config_unsupported_fields_one_line_error(adapter, cfg, needle):
    from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
    from models.llama3.state_dict_adapter import Llama3StateDictAdapter

    cls = Llama3StateDictAdapter if adapter == "llama" else DeepSeekV3StateDictAdapter
    with pytest.raises(HFConfigError) as e:
        cls.args_from_hf(cfg)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and msg.startswith("hf error:")


@pytest.mark.parametrize("model,flavor", [("llama3", "debug"), ("llama3", "8B"), ("llama3", "70B"),
                                          ("llama3", "405B"), ("deepseek_v3", "debug"), ("deepseek_v3", "671B"),
                                          ("deepseek_v3", "16B")])
def test_args_config_roundtrip_published_flavors(model, flavor):
    """args -> HF config.json -> args gives back the published flavor itself (16B: as deepseek_v2)."""
    from models import get_model_spec

    spec = get_model_spec(model)
    args = spec.flavors[flavor]
    cfg = json.loads(json.dumps(spec.state_dict_adapter.for_args(args).hf_config()))
    assert cfg["model_type"] == {"llama3": "llama", "deepseek_v3": "deepseek_v2" if flavor == "16B" else "deepseek_v3"}[model]
    assert spec.state_dict_adapter.args_from_hf(cfg) == args


def test_published_config_shapes():
    """Real published config.json files (legacy spelling) map to our flavors."""
    from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter as DS
    from models.llama3 import LLAMA3_FLAVORS
    from models.llama3.state_dict_adapter import Llama3StateDictAdapter as L

    llama31_8b = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                  "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
                  "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
                  "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
                  "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                  "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                  "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}
    assert L.args_from_hf(llama31_8b) == LLAMA3_FLAVORS["8B"]
    ds_v3 = {**_ds_cfg(), "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
             "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
             "num_key_value_heads": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
             "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
             "qk_nope_head_dim": 128, "v_head_dim": 128, "n_group": 8, "topk_group": 4, "n_shared_experts": 1,
             "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "norm_topk_prob": True, "ep_size": 1,
             "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
             "num_nextn_predict_layers": 1, "moe_layer_freq": 1, "aux_loss_alpha": 0.001, "seq_aux": True,
             "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                   "type": "yarn"},
             "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}}
    from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS

    args = DS.args_from_hf(ds_v3)
    assert DS.signature(args) == DS.signature(DEEPSEEK_V3_FLAVORS["671B"]) and args.max_seq_len == 163840
    # DeepSeek-V2-Lite (softmax routing) is the 16B flavor; config.json as published.
    v2_lite = {"architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
               "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
               "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
               "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
               "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
               "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"},
               "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
               "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
               "use_cache": True, "v_head_dim": 128, "vocab_size": 102400, "ep_size": 1}
    args = DS.args_from_hf(v2_lite)
    assert DS.signature(args) == DS.signature(DEEPSEEK_V3_FLAVORS["16B"]) and args.max_seq_len == 163840


# --------------------------------------------------------------------------- errors


def test_missing_and_unexpected_keys_one_error(hf_dirs, tmp_path):
    from safetensors.torch import save_file

    src = hf_dirs["deepseek_qlora_yarn"]
    reader = HFReader(src)
    sd = {k: reader.full(k) for k in reader.keys()}
    del sd["model.layers.1.mlp.experts.5.up_proj.weight"]
    del sd["model.layers.0.self_attn.q_a_layernorm.weight"]
    sd["model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
    sd["model.norm.weight"] = torch.ones(3)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    save_file(sd, str(bad / "model.safetensors"))
    spec, args = args_from_hf_folder(bad)
    with pytest.raises(HFConfigError) as e:
        load_hf_into_model([spec.model_cls(args)], bad)
    msg = str(e.value)
    assert "\n" not in msg and "missing 2 key(s)" in msg and "experts.5.up_proj" in msg and "q_a_layernorm" in msg
    assert "unexpected 1 key(s)" in msg and "bogus" in msg and "model.norm.weight (3,) != (64,)" in msg


def test_config_mismatch_names_the_fields_and_flavor(tmp_path):
    """Loading an HF folder into a model of another shape says what differs and which flavor fits."""
    from models import get_model_spec

    spec = get_model_spec("llama3")
    args = spec.flavors["debug_small"]
    out = tmp_path / "small"
    save_hf_state_dict({k: torch.zeros(s) for k, s in spec.state_dict_adapter(args).native_shapes().items()},
                       spec, args, out)
    model = spec.model_cls(spec.flavors["debug"])
    with pytest.raises(HFConfigError) as e:
        load_hf_into_model([model], out)
    msg = str(e.value)
    assert "dim: 64 != 256" in msg and "--model.flavor debug_small" in msg and "\n" not in msg


# --------------------------------------------------------------------------- FP8


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", [(128, 128), (32, 24)])
def test_fp8_block_quantized_import(block, hf_dirs, tmp_path):
    """DeepSeek V3's FP8 layout (weight in float8_e4m3fn, weight_scale_inv per block, partial
    edge blocks) is dequantized on import: exactly the reference dequantization (whole
    tensors and any region), and the original weights within float8 rounding."""
    from safetensors.torch import load_file

    src = hf_dirs["deepseek_qlora_yarn"]
    fp8, twin = quantize_hf_folder_fp8(src, tmp_path, block)
    orig = load_file(str(src / "model.safetensors"))
    quantized = [k for k, v in orig.items() if _is_fp8_weight(k, v)]
    assert any(v.shape[0] % block[0] or v.shape[1] % block[1] for k, v in orig.items() if k in quantized)

    reader, ref = HFReader(fp8), HFReader(twin)
    g = torch.Generator().manual_seed(0)
    for k in quantized:
        got = reader.full(k)
        assert got.dtype == torch.float32 and torch.equal(got, ref.full(k)), k
        # float8 e4m3: 3 mantissa bits (relative error <= 2^-4), subnormals down to 2^-9 of the scale.
        scale = load_file(str(fp8 / "model.safetensors"))[k + "_scale_inv"]
        scale = scale.repeat_interleave(block[0], 0)[:got.shape[0]].repeat_interleave(block[1], 1)[:, :got.shape[1]]
        assert ((got - orig[k]).abs() <= orig[k].abs() * 2**-4 + scale * 2**-9).all(), k
        r0, c0 = (int(torch.randint(0, n, (1,), generator=g)) for n in got.shape)
        r1, c1 = (int(torch.randint(a + 1, n + 1, (1,), generator=g)) for a, n in zip((r0, c0), got.shape))
        assert torch.equal(reader.get(k, (slice(r0, r1), slice(c0, c1))), got[r0:r1, c0:c1]), k

    # The whole import (trainer path) gives the twin's model, bitwise.
    _, _, sd_fp8 = load_hf_state_dict(fp8)
    _, _, sd_twin = load_hf_state_dict(twin)
    assert sd_fp8.keys() == sd_twin.keys() and all(torch.equal(sd_fp8[k], sd_twin[k]) for k in sd_fp8)
    tokens = tokens_for(256)
    with torch.no_grad():
        assert torch.equal(our_model_from_hf(fp8)(tokens), our_model_from_hf(twin)(tokens))


def test_softmax_model_exports_as_deepseek_v2_only_with_its_bias_at_zero(hf_dirs, tmp_path):
    """A softmax-routed model (the 16B flavor's routing) exports as HF deepseek_v2; a routing
    bias that moved (aux-loss-free balancing) has no place there: one line, nothing written."""
    src = hf_dirs["deepseek_v2_greedy"]
    spec, args, sd = load_hf_state_dict(src)
    assert args.score_func == "softmax" and all(not v.any() for k, v in sd.items() if k.endswith("expert_bias"))
    save_hf_state_dict(sd, spec, args, tmp_path / "ok")
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["model_type"] == "deepseek_v2"
    sd["layers.1.moe.expert_bias"] = sd["layers.1.moe.expert_bias"] + 1e-3
    with pytest.raises(HFConfigError) as e:
        save_hf_state_dict(sd, spec, args, tmp_path / "moved")
    msg = str(e.value)
    assert "\n" not in msg and "layers.1.moe.expert_bias" in msg and "--moe.bias_update_rate 0" in msg
    assert not (tmp_path / "moved").exists()
