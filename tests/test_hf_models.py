"""HF interop, one process: small random transformers models -> our models -> back.

Every case builds a random HF model locally (no hub), with weights chosen so that
RoPE and routing matter (q/k weights large enough for peaked attention, non-unit
norm gains, random routing biases, one expert that never receives a token), saves
it with `save_pretrained`, loads it into our model and compares logits in fp32;
then exports ours with `save_hf` and reloads that with transformers. The builders live in
tests/hf_builders.py (shared with the other HF tests).
"""

from __future__ import annotations

import json

import pytest
import torch

import transformers  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)
import safetensors  # noqa: F401  (the dev extra installs it: missing, this fails, not skips)

from models.hf_config import HFConfigError  # noqa: E402
from trainer.hf_io import (  # noqa: E402
    HFReader,
    args_from_hf_folder,
    load_hf_into_model,
    load_hf_state_dict,
    save_hf,
    save_hf_state_dict,
)
from tests.hf_builders import (  # noqa: E402
    is_fp8_weight,
    build_hf_deepseek,
    build_hf_deepseek_v2,
    build_hf_llama,
    hf_logits,
    load_hf_model,
    our_model_from_hf,
    quantize_hf_folder_fp8,
    tokens_for,
)

TOL = 1e-4
# Measured max |diff| per case, printed by `pytest -s` (and kept for the report).
MEASURED: dict[str, float] = {}


CASES = {
    "llama_gqa_llama3rope": lambda d: build_hf_llama(d, gqa=True, rope_scaling=True),
    "llama_mha_tied_legacycfg": lambda d: build_hf_llama(d, gqa=False, rope_scaling=False, tied=True, legacy=True),
    "deepseek_qlora_yarn": lambda d: build_hf_deepseek(d, q_lora=True, yarn=True),
    "deepseek_noqlora_legacycfg": lambda d: build_hf_deepseek(d, q_lora=False, yarn=True, legacy=True),
    # Softmax routing (our 16B flavor's) lives in HF's DeepSeek V2.
    "deepseek_v2_greedy": lambda d: build_hf_deepseek_v2(d, grouped=False),
    "deepseek_v2_grouped_legacycfg": lambda d: build_hf_deepseek_v2(d, grouped=True, legacy=True),
}


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
    quantized = [k for k, v in orig.items() if is_fp8_weight(k, v)]
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
