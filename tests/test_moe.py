"""MoE building blocks: routing, grouped experts vs a per-expert loop, permutation,
aux-loss-free balancing and the sequence-level balance loss."""

import pytest
import torch
import torch.nn.functional as F

import models.common.moe_balance as balance_mod
from models.common.grouped_gemm import experts_grouped_mm, experts_loop, grouped_mm_supported
from models.common.moe import GroupedExperts, MoE, MoEArgs, TopKRouter, select_experts, sequence_balance_loss
from models.common.moe_balance import moe_aux_loss, update_moe_load_balance_bias

# ----------------------------------------------------------------------------- routing

# 8 experts in 4 groups of 2. Top-2 sums per group: 0.9, 1.01, 0.88, 0.86; maxima: 0.9, 0.51, 0.44, 0.85.
GROUP_ROW = [0.9, 0.0, 0.5, 0.51, 0.44, 0.44, 0.85, 0.01]


def _ids(t):
    return sorted(t.tolist())


def test_plain_topk():
    scores = torch.tensor([[0.1, 0.7, 0.05, 0.15], [0.4, 0.1, 0.3, 0.2]])
    ids = select_experts(scores, 2, score_func="softmax")
    assert [_ids(r) for r in ids] == [[1, 3], [0, 2]]


def test_group_limited_sigmoid_uses_top2_sum():
    scores = torch.tensor([GROUP_ROW])
    # Without groups the best two are experts 0 and 6.
    assert _ids(select_experts(scores, 2, score_func="sigmoid")[0]) == [0, 6]
    # Groups 1 (1.01) and 0 (0.9) survive; group 3 (0.86) is excluded, so expert 6 cannot be picked.
    ids = select_experts(scores, 2, n_groups=4, topk_groups=2, score_func="sigmoid")
    assert _ids(ids[0]) == [0, 3]
    ids = select_experts(scores, 3, n_groups=4, topk_groups=2, score_func="sigmoid")
    assert _ids(ids[0]) == [0, 2, 3]


def test_group_limited_softmax_uses_max():
    scores = torch.tensor([GROUP_ROW])
    # Group maxima keep groups 0 (0.9) and 3 (0.85).
    ids = select_experts(scores, 2, n_groups=4, topk_groups=2, score_func="softmax")
    assert _ids(ids[0]) == [0, 6]
    ids = select_experts(scores, 3, n_groups=4, topk_groups=2, score_func="softmax")
    assert _ids(ids[0]) == [0, 6, 7]


def test_group_limited_single_group_kept():
    scores = torch.tensor([GROUP_ROW])
    ids = select_experts(scores, 2, n_groups=4, topk_groups=1, score_func="sigmoid")
    assert _ids(ids[0]) == [2, 3]


def test_bias_changes_selection_only():
    args = MoEArgs(num_experts=4, top_k=2, score_func="sigmoid", route_norm=False, route_scale=1.0)
    router = TopKRouter(4, args)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4))
    logits = torch.tensor([[2.0, 1.0, -2.0, 0.0]])
    w, ids, scores = router(logits)
    assert _ids(ids[0]) == [0, 1]
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])
    w, ids, scores = router(logits, bias)
    assert _ids(ids[0]) == [0, 2]
    # Weights are the unbiased scores of the picked experts.
    torch.testing.assert_close(w[0].sort().values, torch.sigmoid(torch.tensor([-2.0, 2.0])))


def test_router_weights_sigmoid_normalised_and_scaled():
    args = MoEArgs(num_experts=8, top_k=3, score_func="sigmoid", route_scale=2.5, n_groups=4, topk_groups=2)
    router = TopKRouter(8, args)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(8))
    x = torch.randn(16, 8)
    w, ids, scores = router(x)
    torch.testing.assert_close(w.sum(-1), torch.full((16,), 2.5))
    s = torch.sigmoid(x).gather(1, ids)
    torch.testing.assert_close(w, 2.5 * s / s.sum(-1, keepdim=True))


def test_router_weights_softmax_not_normalised():
    args = MoEArgs(num_experts=6, top_k=2, score_func="softmax", route_scale=1.5)
    router = TopKRouter(6, args)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(6))
    x = torch.randn(5, 6)
    w, ids, scores = router(x)
    p = x.softmax(-1)
    assert torch.equal(ids.sort(-1).values, p.topk(2, -1).indices.sort(-1).values)
    torch.testing.assert_close(w, 1.5 * p.gather(1, ids))


# ----------------------------------------------------------------------------- experts


def _expert_weights(e=4, d=16, h=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g, dtype=torch.float32) * 0.2).to(dtype).requires_grad_()
            for shape in ((e, d, h), (e, h, d), (e, d, h))]


@pytest.mark.parametrize("counts", [[5, 0, 1, 10], [0, 7, 3, 0], [16, 0, 0, 0]])
def test_grouped_mm_matches_loop_forward_and_backward(counts):
    ws = _expert_weights()
    x = torch.randn(sum(counts), 16, requires_grad=True)
    n = torch.tensor(counts)
    assert grouped_mm_supported(x, *ws)
    out_g = experts_grouped_mm(*ws, x, n)
    gout = torch.randn_like(out_g)
    grads_g = torch.autograd.grad(out_g, [x, *ws], gout)

    ws2 = [w.detach().clone().requires_grad_() for w in ws]
    x2 = x.detach().clone().requires_grad_()
    out_l = experts_loop(*ws2, x2, n)
    grads_l = torch.autograd.grad(out_l, [x2, *ws2], gout)
    torch.testing.assert_close(out_g, out_l, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_g, grads_l):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Experts without tokens get exactly zero gradient.
    for e, c in enumerate(counts):
        if c == 0:
            assert all(g[e].abs().max() == 0 for g in grads_g[1:])


def test_grouped_mm_backward_with_expanded_grad():
    """out.sum() sends a stride-0 gradient, which the CPU grouped-mm backward cannot take raw."""
    ws = _expert_weights()
    x = torch.randn(9, 16, requires_grad=True)
    n = torch.tensor([2, 3, 0, 4])
    experts_grouped_mm(*ws, x, n).sum().backward()
    ref = [w.detach().clone().requires_grad_() for w in ws]
    experts_loop(*ref, x.detach(), n).sum().backward()
    for a, b in zip(ws, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_padding_rows_are_ignored():
    """Rows past the last offset (EP padding) do not affect the real rows."""
    ws = _expert_weights()
    x = torch.randn(12, 16)
    n = torch.tensor([3, 0, 4, 1])  # 8 real rows, 4 padding rows
    with torch.no_grad():
        out_g = experts_grouped_mm(*ws, x, n)
        out_l = experts_loop(*ws, x, n)
    assert out_g.shape == out_l.shape == (12, 16)
    torch.testing.assert_close(out_g[:8], out_l[:8], rtol=1e-5, atol=1e-6)
    assert out_l[8:].abs().max() == 0


def test_grouped_mm_bf16_close_to_loop():
    ws = _expert_weights(dtype=torch.bfloat16)
    x = torch.randn(10, 16, dtype=torch.bfloat16)
    n = torch.tensor([4, 0, 5, 1])
    with torch.no_grad():
        torch.testing.assert_close(experts_grouped_mm(*ws, x, n).float(), experts_loop(*ws, x, n).float(),
                                   rtol=2e-2, atol=2e-2)


def test_misaligned_strides_fall_back_to_loop():
    experts = GroupedExperts(dim=6, hidden_dim=10, num_experts=3)  # 24- and 40-byte rows: not 16-byte multiples
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w, std=0.3)
    x = torch.randn(7, 6)
    n = torch.tensor([2, 2, 3])
    assert not grouped_mm_supported(x, experts.w1, experts.w2, experts.w3)
    torch.testing.assert_close(experts(x, n), experts_loop(experts.w1, experts.w2, experts.w3, x, n))


# ----------------------------------------------------------------------------- MoE layer


def _moe(dim=16, hidden=32, use_grouped_mm=True, **kw):
    torch.manual_seed(0)
    args = MoEArgs(**{**dict(num_experts=8, top_k=2, num_shared_experts=1, score_func="sigmoid", n_groups=4,
                             topk_groups=2, route_scale=1.0, use_grouped_mm=use_grouped_mm), **kw})
    m = MoE(dim, hidden, args)
    m.init_weights(0.1, 0.1)
    return m


def test_moe_matches_per_token_reference():
    m = _moe()
    x = torch.randn(2, 5, 16)
    out = m(x)
    flat = x.reshape(-1, 16)
    w, ids, _ = m.router(flat, m.expert_bias)
    ref = m.shared_experts(flat)
    e = m.experts
    for t in range(flat.shape[0]):
        for k in range(2):
            i = ids[t, k]
            h = F.silu(flat[t] @ e.w1[i]) * (flat[t] @ e.w3[i])
            ref[t] += w[t, k] * (h @ e.w2[i])
    torch.testing.assert_close(out.reshape(-1, 16), ref, rtol=1e-5, atol=1e-6)


def test_moe_grouped_equals_loop_including_grads():
    a, b = _moe(use_grouped_mm=True), _moe(use_grouped_mm=False)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 7, 16)
    out_a, out_b = a(x), b(x)
    torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=1e-6)
    out_a.square().sum().backward()
    out_b.square().sum().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_permute_unpermute_roundtrip():
    m = _moe()
    x = torch.randn(6, 16)
    ids = torch.tensor([[3, 1], [1, 0], [7, 3], [3, 2], [0, 1], [5, 3]])
    routed, counts, order = m.permute(x, ids)
    assert counts.tolist() == [2, 3, 1, 4, 0, 1, 0, 1]
    # Rows grouped by expert, ties in token order (stable).
    assert torch.equal(routed[:2], x[[1, 4]])
    assert torch.equal(routed[6:10], x[[0, 2, 3, 5]])
    weights = torch.tensor([[0.25, 0.75]]).expand(6, 2)
    torch.testing.assert_close(m.unpermute(routed, order, weights), x)


def test_counters_and_state_dict():
    m = _moe()
    m(torch.randn(2, 5, 16))
    m(torch.randn(1, 4, 16))
    assert m.tokens_per_expert.sum().item() == (10 + 4) * 2
    sd = m.state_dict()
    assert "expert_bias" in sd and "tokens_per_expert" not in sd and "aux_loss" not in sd
    assert {"router.gate.weight", "experts.w1", "experts.w2", "experts.w3", "shared_experts.w1.weight"} <= set(sd)
    assert sd["experts.w1"].shape == (8, 16, 32) and sd["experts.w2"].shape == (8, 32, 16)


# ----------------------------------------------------------------------------- balancing


def _load_ratio(m):
    c = m.tokens_per_expert.float()
    return (c.max() / c.mean()).item()


def test_bias_update_balances_skewed_router():
    m = _moe(n_groups=1, topk_groups=1)
    with torch.no_grad():
        m.router.gate.weight[:2, 0] += 3.0  # experts 0 and 1 favoured when x[:, 0] > 0
    torch.manual_seed(1)
    x = torch.randn(1, 512, 16)
    x[..., 0] = 1.0
    ratios = []
    with torch.no_grad():
        for _ in range(40):
            m(x)
            ratios.append(_load_ratio(m))
            update_moe_load_balance_bias(m, coeff=0.02)
            assert m.tokens_per_expert.sum() == 0
    assert ratios[0] > 3.0  # experts 0 and 1 take nearly every token's picks
    # Sign updates settle into a small limit cycle around balance (about 1.3 here).
    assert max(ratios[-5:]) < 1.5 and max(ratios[-5:]) < 0.4 * ratios[0]
    assert m.expert_bias[:2].max() < m.expert_bias[2:].min()
    assert m.expert_bias.grad is None and not m.expert_bias.requires_grad


def test_bias_update_all_reduces_over_group(monkeypatch):
    m = _moe()
    with torch.no_grad():
        m.tokens_per_expert.copy_(torch.tensor([5, 1, 1, 1, 1, 1, 1, 5]))
    calls = []

    def fake_all_reduce(t, group=None):
        calls.append(group)
        t.mul_(2)
        t[:, 1] += 100  # another rank saw many tokens for expert 1

    monkeypatch.setattr(balance_mod.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(balance_mod.dist, "all_reduce", fake_all_reduce)
    update_moe_load_balance_bias([m], coeff=0.01, dp_group="GROUP")
    assert calls == ["GROUP"]
    torch.testing.assert_close(m.expert_bias, torch.tensor([1, -1, 1, 1, 1, 1, 1, 1.0]) * 0.01)


def test_aux_loss_value_and_gradient():
    m = _moe(aux_loss_coeff=0.0)
    x = torch.randn(2, 6, 16)
    m(x).sum().backward()
    g0 = m.router.gate.weight.grad.clone()
    assert moe_aux_loss(m).item() == 0.0

    m.zero_grad()
    m.args.aux_loss_coeff = 0.5
    m(x).sum().backward()
    g1 = m.router.gate.weight.grad.clone()
    # The gradient difference is exactly that of 0.5 * the balance loss.
    m.zero_grad()
    w, ids, scores = m.router(x.reshape(-1, 16), m.expert_bias)
    expected = 0.5 * sequence_balance_loss(scores, ids, 2, 8, "sigmoid")
    expected.backward()
    torch.testing.assert_close(g1 - g0, m.router.gate.weight.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(moe_aux_loss(m), expected.detach())


def test_sequence_balance_loss_is_one_when_uniform():
    # Uniform scores and uniform picks: sum_i f_i P_i = sum_i 1 * 1/E = 1.
    e, s = 4, 8
    scores = torch.full((s, e), 0.5)
    ids = torch.tensor([[0, 1], [2, 3]] * (s // 2))
    torch.testing.assert_close(sequence_balance_loss(scores, ids, 1, e, "sigmoid"), torch.tensor(1.0))


def test_grouped_mm_supported_rules():
    w = torch.zeros(2, 16, 32)
    assert grouped_mm_supported(torch.zeros(3, 16), w, w.transpose(1, 2).contiguous(), w)
    wb = w.bfloat16()
    assert grouped_mm_supported(torch.zeros(3, 16, dtype=torch.bfloat16), wb, wb.transpose(1, 2).contiguous(), wb)
    wh = w.half()
    assert not grouped_mm_supported(torch.zeros(3, 16, dtype=torch.float16), wh, wh.transpose(1, 2).contiguous(), wh)
    w6 = torch.zeros(2, 16, 6)  # hidden rows of 24 bytes
    assert not grouped_mm_supported(torch.zeros(3, 16), w6, w6.transpose(1, 2).contiguous(), w6)
