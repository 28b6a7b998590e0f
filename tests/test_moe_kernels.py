"""MoE kernels for the first GPU run: padded grouped GEMM (no empty expert group reaches the
kernel) and the fp32 router gate.

The padding (`align` > 0) is what CUDA runs (8 rows for bf16, 16 for float8); CPU's kernel
needs none, so here it is forced on and compared with the per-expert loop, forward and
backward, with empty experts, rows past the counts (EP padding), and a rank that got
nothing at all.
"""

from __future__ import annotations

import pytest
import torch

from models.common.grouped_gemm import experts_grouped_mm, experts_loop, grouped_mm_alignment, padded_group_layout
from models.common.moe import MoEArgs, TopKRouter


def _weights(e=4, d=16, h=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g) * 0.2).requires_grad_() for shape in ((e, d, h), (e, h, d), (e, d, h))]


@pytest.mark.parametrize("align", [8, 16])
@pytest.mark.parametrize("counts,extra_rows", [([5, 0, 1, 10], 0), ([0, 7, 3, 0], 2), ([16, 0, 0, 0], 0),
                                               ([0, 0, 0, 0], 1), ([9, 8, 17, 1], 0)])
def test_padded_grouped_mm_equals_loop(counts, extra_rows, align):
    ws = _weights()
    used = sum(counts)
    x = torch.randn(used + extra_rows, 16, requires_grad=True)
    n = torch.tensor(counts)
    out = experts_grouped_mm(*ws, x, n, align=align)
    assert out.shape == x.shape
    gout = torch.randn_like(out)
    gout[used:] = 0  # callers drop the padding rows
    grads = torch.autograd.grad(out, [x, *ws], gout)

    ref_ws = [w.detach().clone().requires_grad_() for w in ws]
    ref_x = x.detach().clone().requires_grad_()
    ref = experts_loop(*ref_ws, ref_x, n)
    ref_grads = torch.autograd.grad(ref, [ref_x, *ref_ws], gout)
    torch.testing.assert_close(out[:used], ref[:used], rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for e, c in enumerate(counts):
        if c == 0:  # an empty expert ran on zero rows only: exactly zero gradient
            assert all(g[e].abs().max() == 0 for g in grads[1:])


def test_padded_layout_groups_are_aligned_and_never_empty():
    n = torch.tensor([5, 0, 1, 10, 8])
    dest, src, offs = padded_group_layout(n, 24 + 3, align=8)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert sizes.tolist() == [8, 8, 8, 16, 8]
    assert src.shape[0] == 27 + 5 * 8 + 1  # static: any routing fits
    assert torch.equal(src[dest[:24]], torch.arange(24))  # every real row lands in its slot
    assert (dest[24:] == src.shape[0] - 1).all()  # rows past the counts go to the spare slot
    starts = offs - sizes
    for e, c in enumerate(n.tolist()):  # each expert's rows, in order, at the start of its group
        first = int(n[:e].sum())
        assert dest[first:first + c].tolist() == list(range(int(starts[e]), int(starts[e]) + c))


def test_alignment_is_cuda_only():
    assert grouped_mm_alignment(torch.zeros(1)) == 0
    assert grouped_mm_alignment(torch.zeros(1, device="meta")) == 0


def test_router_gate_runs_in_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    router = TopKRouter(64, MoEArgs(num_experts=8, top_k=2))
    router.init_weights(0.02)
    x = torch.randn(32, 64).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router.gate(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ router.gate.weight.float().t(), rtol=1e-6, atol=1e-6)
    router_bf16 = TopKRouter(64, MoEArgs(num_experts=8, top_k=2)).to(torch.bfloat16)  # FSDP's bf16 gather
    router_bf16.load_state_dict(router.state_dict())
    weights, ids, scores = router_bf16(x)
    assert weights.dtype == scores.dtype == torch.float32
    torch.testing.assert_close(scores, (x.float() @ router_bf16.gate.weight.float().t()).sigmoid())
    router64 = TopKRouter(64, MoEArgs(num_experts=8, top_k=2)).double()  # fp64 stays fp64 (gradcheck, refs)
    router64.load_state_dict(router.state_dict())
    logits64 = router64.gate(x.double())
    assert logits64.dtype == torch.float64
    torch.testing.assert_close(logits64, x.double() @ router.gate.weight.double().t(), rtol=1e-12, atol=1e-12)
