"""FSDP details the first GPU run depends on: RoPE stays fp32 under bf16 (the table is an
input FSDP would cast; the rotation runs in fp32, rounded once), and explicit prefetch under EP."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from models.common.rope import apply_rope, rope_cos_sin, rotate_half


def test_bf16_rotation_is_the_fp32_one_rounded_once():
    torch.manual_seed(0)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)).float()
    table = rope_cos_sin(inv_freq, 8192)
    x = torch.randn(1, 8192, 2, 64).to(torch.bfloat16)
    got = apply_rope(x, table)
    assert got.dtype == torch.bfloat16
    xf = x.float()
    exact = xf * table[:, 0].unsqueeze(1) + rotate_half(xf) * table[:, 1].unsqueeze(1)
    assert torch.equal(got, exact.to(torch.bfloat16))
    # What a bf16 rotation would give: visibly worse than one rounding.
    cos, sin = table[:, 0].unsqueeze(1).to(x.dtype), table[:, 1].unsqueeze(1).to(x.dtype)
    in_bf16 = x * cos + rotate_half(x) * sin
    err = lambda t: (t.float() - exact).abs().mean().item()  # noqa: E731
    assert err(got) < 0.7 * err(in_bf16), (err(got), err(in_bf16))


def test_rotation_backward_is_exact_and_saves_only_the_table():
    table = rope_cos_sin(1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)), 16).double()
    x = torch.randn(2, 16, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, table), (x,))
    table32 = table.float()
    saved = []
    xb = torch.randn(2, 16, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = apply_rope(xb, table32)
    assert y.dtype == torch.bfloat16
    # Only views of the shared fp32 table are kept: no per-call copy of x or of the table.
    assert saved and all(t.untyped_storage().data_ptr() == table32.untyped_storage().data_ptr() for t in saved)
    y.float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16


def test_rope_cache_stays_fp32_under_fsdp_bf16(monkeypatch):
    """FSDP2 casts every floating-point forward input of a unit to the param dtype; the
    blocks opt out (parallelisms/fsdp.py), so the table reaches the rotation in fp32."""
    from torch.distributed.device_mesh import init_device_mesh

    from models.llama3 import LLAMA3_FLAVORS, Llama3
    from parallelisms.fsdp import apply_fsdp

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = Llama3(dataclasses.replace(LLAMA3_FLAVORS["debug_small"], n_layers=1))
        model.init_weights()
        seen = []
        import models.common.rope as rope

        real = rope.apply_rope

        def spy(x, cos_sin):
            seen.append((x.dtype, cos_sin.dtype))
            return real(x, cos_sin)

        for mod in ("models.llama3.model", "models.common.rope"):
            monkeypatch.setattr(f"{mod}.apply_rope", spy, raising=False)
        apply_fsdp(model, init_device_mesh("cpu", (1,)), param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                   backend="gloo")
        model(torch.randint(0, 2048, (1, 32))).float().sum().backward()
        assert model.rope_cache.dtype == torch.float32
        assert seen and all(x == torch.bfloat16 and c == torch.float32 for x, c in seen), seen
    finally:
        dist.destroy_process_group()


def test_explicit_prefetch_under_ep():
    """Under EP (experts marked for their own FSDP mesh) every unit prefetches the next one,
    a MoE block with its experts, in forward, and the previous one in backward."""
    from torch.distributed.device_mesh import init_device_mesh

    from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3
    from models.common.moe import MoE
    from parallelisms.fsdp import apply_fsdp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        args = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debug"], n_layers=3)
        with torch.device("meta"):
            model = DeepSeekV3(args)
        mesh = init_device_mesh("cpu", (1,))
        for m in model.modules():
            if isinstance(m, MoE):
                m.experts._expert_fsdp_mesh = mesh  # what apply_expert_parallel records
        apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, backend="gloo")
        blocks = list(model.layers.values())
        state = lambda m: m._get_fsdp_state()  # noqa: E731
        fwd = lambda m: list(state(m)._states_to_forward_prefetch)  # noqa: E731
        bwd = lambda m: list(state(m)._states_to_backward_prefetch)  # noqa: E731
        assert fwd(model.tok_embeddings) == [state(blocks[0])]  # block 0 is dense
        assert fwd(blocks[0]) == [state(blocks[1]), state(blocks[1].moe.experts)]
        assert fwd(blocks[1]) == [state(blocks[2]), state(blocks[2].moe.experts)]
        assert fwd(blocks[2]) == [state(model.norm)]
        assert bwd(model.norm) == [state(blocks[2]), state(blocks[2].moe.experts)]
        assert bwd(blocks[1]) == [state(blocks[0])]
    finally:
        dist.destroy_process_group()
