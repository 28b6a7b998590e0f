"""DeepSeek V3: parameter counts, MLA, YaRN, rope layout, model conventions, a short training run."""

import math

import pytest
import torch
import torch.nn.functional as F

from models import MODEL_SPECS
from models.common.moe import MoE
from models.common.rope import apply_rope, rope_cos_sin
from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3, DeepSeekV3Args, count_params, interleaved_to_half_perm
from models.deepseek_v3.model import MLA, yarn_inv_freq


def tiny_args(**kw) -> DeepSeekV3Args:
    base = dict(
        vocab_size=256, dim=64, n_layers=3, n_dense_layers=1, inter_dim=128, max_seq_len=64,
        moe_inter_dim=32, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        n_expert_groups=4, n_limited_groups=2, score_func="sigmoid", route_scale=1.0,
        n_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        rope_factor=1.0,
    )
    base.update(kw)
    return DeepSeekV3Args(**base)


def build(args, seed=0) -> DeepSeekV3:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = DeepSeekV3(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


# ----------------------------------------------------------------------------- counts


def test_671b_param_counts_exact():
    args = DEEPSEEK_V3_FLAVORS["671B"]
    assert count_params(args) == (671_026_419_200, 37_552_297_472)
    assert args.param_counts() == (671_026_419_200, 37_552_297_472)


def test_16b_param_counts():
    # DeepSeek-V2-Lite shape: 15.7B total, 2.66B activated (2.45B without embedding and head).
    args = DEEPSEEK_V3_FLAVORS["16B"]
    assert count_params(args) == (15_706_485_888, 2_661_151_872)
    assert args.param_counts() == count_params(args)


@pytest.mark.parametrize("flavor", sorted(DEEPSEEK_V3_FLAVORS))
def test_analytic_counts_match_meta_model(flavor):
    args = DEEPSEEK_V3_FLAVORS[flavor]
    assert args.param_counts() == count_params(args)


def test_flops_per_token():
    a = DEEPSEEK_V3_FLAVORS["671B"]
    _, act = a.param_counts()
    expected = 6 * (act - a.vocab_size * a.dim) + 6 * 61 * 128 * (192 + 128) * 4096
    assert a.flops_per_token(4096) == expected
    summary = MODEL_SPECS["deepseek_v3"].summary_fn(build(tiny_args()), tiny_args(), 32)
    assert summary["params"] == tiny_args().param_counts()[0]
    assert summary["activated_params"] == tiny_args().param_counts()[1] < summary["params"]


# ----------------------------------------------------------------------------- rope / yarn


def test_yarn_inv_freq():
    base = yarn_inv_freq(64, 10000.0, 1.0, 4096, 32, 1)
    torch.testing.assert_close(base, 1.0 / (10000.0 ** (torch.arange(0, 64, 2).double() / 64)).float())
    y = yarn_inv_freq(64, 10000.0, 40.0, 4096, 32, 1)
    # Correction range for these settings: pairs 0..10 keep their frequency, 23.. are divided by 40.
    torch.testing.assert_close(y[:11], base[:11])
    torch.testing.assert_close(y[23:], base[23:] / 40)
    mid = y[11:23] / base[11:23]
    assert ((mid < 1) & (mid > 1 / 40)).all() and (mid.diff() < 0).all()


def test_softmax_scale_has_yarn_mscale():
    a = DEEPSEEK_V3_FLAVORS["671B"]
    assert a.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    b = DEEPSEEK_V3_FLAVORS["16B"]
    assert b.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2)
    assert tiny_args().softmax_scale == pytest.approx(24**-0.5)


def _interleaved_rope(x, inv_freq, positions):
    """Reference for DeepSeek's checkpoint layout: channel pairs (2i, 2i+1) rotate together."""
    ang = positions[:, None].float() * inv_freq[None]  # [S, d/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def test_rope_layout_permutation_for_hf_adapter():
    d, s = 16, 10
    inv_freq = yarn_inv_freq(d, 10000.0, 4.0, 8, 32, 1)
    cache = rope_cos_sin(inv_freq, s)
    x = torch.randn(2, s, 3, d)
    perm = interleaved_to_half_perm(d)
    assert perm.tolist()[:4] == [0, 2, 4, 6] and perm.tolist()[d // 2:d // 2 + 2] == [1, 3]
    torch.testing.assert_close(apply_rope(x[..., perm], cache), _interleaved_rope(x, inv_freq, torch.arange(s))[..., perm])


# ----------------------------------------------------------------------------- MLA


def _naive_mla(attn: MLA, x, rope):
    b, s, _ = x.shape
    q = attn.wq(x) if attn.q_lora_rank == 0 else attn.wq_b(attn.q_norm(attn.wq_a(x)))
    q = q.view(b, s, attn.n_heads, -1)
    kv, k_pe = attn.wkv_a(x).split([attn.kv_lora_rank, attn.rope_dim], -1)
    kv = attn.wkv_b(attn.kv_norm(kv)).view(b, s, attn.n_heads, -1)
    q_pe = apply_rope(q[..., attn.nope_dim:], rope)
    k_pe = apply_rope(k_pe[:, :, None], rope)
    scores = (torch.einsum("bshd,bthd->bhst", q[..., :attn.nope_dim], kv[..., :attn.nope_dim])
              + torch.einsum("bshd,btxd->bhst", q_pe, k_pe)) * attn.softmax_scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), kv[..., attn.nope_dim:])
    return attn.wo(out.reshape(b, s, -1))


@pytest.mark.parametrize("q_lora_rank,rope_factor", [(0, 1.0), (32, 4.0)])
def test_mla_matches_naive_and_is_causal(q_lora_rank, rope_factor):
    args = tiny_args(q_lora_rank=q_lora_rank, rope_factor=rope_factor, original_seq_len=16)
    model = build(args)
    attn = model.layers["0"].attention
    assert hasattr(attn, "wq") == (q_lora_rank == 0)
    x = torch.randn(2, 12, 64)
    rope = model.rope_cache[:12]
    out = attn(x, rope)
    assert out.shape == (2, 12, 64)
    torch.testing.assert_close(out, _naive_mla(attn, x, rope), rtol=1e-4, atol=1e-5)
    x2 = x.clone()
    x2[:, 7] += 1.0
    out2 = attn(x2, rope)
    torch.testing.assert_close(out2[:, :7], out[:, :7])
    assert not torch.allclose(out2[:, 7:], out[:, 7:])


# ----------------------------------------------------------------------------- model


def test_model_structure_and_state_dict():
    args = tiny_args()
    model = build(args)
    assert list(model.layers) == ["0", "1", "2"]
    assert hasattr(model.layers["0"], "feed_forward") and not hasattr(model.layers["0"], "moe")
    assert isinstance(model.layers["1"].moe, MoE) and not hasattr(model.layers["1"], "feed_forward")
    sd = model.state_dict()
    assert "layers.1.moe.expert_bias" in sd and "rope_cache" not in sd
    assert not any("tokens_per_expert" in k or "aux_loss" in k for k in sd)
    assert sd["layers.2.moe.experts.w1"].shape == (8, 64, 32)
    assert sd["layers.2.moe.experts.w2"].shape == (8, 32, 64)
    assert sd["layers.2.moe.shared_experts.w1.weight"].shape == (32, 64)
    with torch.device("meta"):
        ref_cache = DeepSeekV3(args).rope_cache
    assert model.rope_cache.shape == ref_cache.shape == (64, 2, 8)


def test_model_forward_causal_and_deterministic():
    model = build(tiny_args())
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256) and torch.isfinite(logits).all()
    assert torch.equal(model(tokens), logits)
    t2 = tokens.clone()
    t2[:, 10] = (t2[:, 10] + 1) % 256
    logits2 = model(t2)
    torch.testing.assert_close(logits2[:, :10], logits[:, :10])
    assert not torch.allclose(logits2[:, 10:], logits[:, 10:])


def test_pipeline_style_missing_parts():
    model = build(tiny_args())
    tokens = torch.randint(0, 256, (1, 8))
    full = model(tokens)
    h = model.tok_embeddings(tokens)
    model.tok_embeddings = None
    model.norm, model.output, norm, output = None, None, model.norm, model.output
    hidden = model(h)
    assert hidden.shape == (1, 8, 64)
    torch.testing.assert_close(output(norm(hidden)), full)


def test_tiny_model_trains_and_balances():
    spec = MODEL_SPECS["deepseek_v3"]
    args = tiny_args()
    model = build(args, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 25), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(6):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert model.layers["1"].moe.tokens_per_expert.sum() == 2 * 24 * 2
        spec.post_optimizer_step_fn(model, None)
        assert model.layers["1"].moe.tokens_per_expert.sum() == 0
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert model.layers["2"].moe.expert_bias.abs().sum() > 0  # the bias moved, by multiples of 1e-3
    assert model.layers["2"].moe.expert_bias.abs().max() <= 6 * args.load_balance_coeff + 1e-9


def test_spec_and_flavors():
    spec = MODEL_SPECS["deepseek_v3"]
    assert spec.model_cls is DeepSeekV3 and set(spec.flavors) >= {"debug", "16B", "671B"}
    assert torch.ops.aten.topk.default in spec.sac_save_ops
    import fnmatch
    assert any(fnmatch.fnmatch("layers.3.moe.router.gate", p) for p in spec.sac_force_recompute_fqns)
    dbg = spec.flavors["debug"]
    assert dbg.n_dense_layers == 1 and dbg.n_layers == 6 and dbg.vocab_size == 2048


@pytest.mark.parametrize("name", ["deepseek_debug.toml", "deepseek_v3_16b.toml", "deepseek_v3_671b.toml"])
def test_train_configs_load(name):
    from trainer.config import load_config

    cfg = load_config(["--config", name])
    assert cfg.model.name == "deepseek_v3"
