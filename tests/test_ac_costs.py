"""Activation checkpointing's costs (FLOPs and saved bytes, analytic and under fake tensors),
the AC_TRACE diagnostics and the state dict's stability across modes. Single-process, fp32,
CPU; the routing, the policy and the bitwise numerics are in test_activation_checkpoint.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX as PREFIX
from torch.utils.checkpoint import CheckpointPolicy

from models.llama3 import Llama3
from parallelisms import ac_sac, ac_trace
from parallelisms.ac_measure import SavedActivationCounter, flop_counter, saved_activation_bytes
from parallelisms.activation_checkpoint import (
    ActivationCheckpointConfig,
    apply_activation_checkpointing,
    reset_ac_trace,
)
from tests.ac_helpers import block_inputs, seeded_llama

MODES = ("none", "full", "selective", "op")  # the eager modes (memory_budget needs compile)
aten = torch.ops.aten


# --------------------------------------------------------------------------- saved bytes




@pytest.mark.parametrize("flavor", ["debug_small", "debug"])
def test_saved_bytes_match_analytic_counts(flavor):
    model = seeded_llama(flavor)
    a = model.args
    x, rope = block_inputs(model)
    tokens = x.shape[0] * x.shape[1]
    block = model.layers["0"]
    d, f, h, kv = a.dim, a.ffn_hidden_dim, a.n_heads, a.kv_heads * a.head_dim
    # none: x, x*rsqrt, normed (attn and ffn each), q, k and v (k, v at the KV heads: SDPA's
    # enable_gqa broadcasts them), SDPA out (which wo reads as a view), h, the SwiGLU's 4
    # [ffn] tensors, 2 rsqrt columns and SDPA's logsumexp.
    assert saved_activation_bytes(block, x, rope, mode="none") == (8 * d + 2 * kv + 4 * f + 2 + h) * tokens * 4
    # full: only the block input.
    assert saved_activation_bytes(block, x, rope, mode="full") == d * tokens * 4
    # op: the input + SDPA's inputs (q and k after RoPE, which the recompute plan keeps
    # instead of wq's output; v, wv's) + w1 (the odd matmuls; not w2, the block's last
    # matmul, whose output the early-stopping recompute never reads) + SDPA out and
    # logsumexp + the 2 rsqrt columns (tiny outputs are kept).
    total, parts = saved_activation_bytes(block, x, rope, mode="op", breakdown=True)
    assert parts == {"autograd": d * tokens * 4, "sac_cache": (2 * d + 2 * kv + f + h + 2) * tokens * 4}
    assert total == sum(parts.values())
    # selective follows the layer id.
    cfg = ActivationCheckpointConfig(selective_layer_interval=2)
    assert saved_activation_bytes(block, x, rope, mode="selective", cfg=cfg, layer_id=1) == \
        saved_activation_bytes(block, x, rope, mode="none")
    assert saved_activation_bytes(block, x, rope, mode="selective", cfg=cfg, layer_id=2) == d * tokens * 4
    with pytest.raises(ValueError, match="partitioner"):
        saved_activation_bytes(block, x, rope, mode="memory_budget")
    # The block was not modified.
    assert not any(isinstance(m, type(model)) for m in block.modules()) and not hasattr(block, "_ac_mode")


def test_saved_bytes_fake_tensor_mode_and_meta_equal_real():
    from torch._subclasses.fake_tensor import FakeTensorMode
    model = seeded_llama("debug_small")
    x, rope = block_inputs(model)
    real = {m: saved_activation_bytes(model.layers["1"], x, rope, mode=m) for m in ("none", "full", "op")}
    with FakeTensorMode():
        fake_model = Llama3(model.args)
        fx = torch.randn(x.shape, requires_grad=True)
        fake = {m: saved_activation_bytes(fake_model.layers["1"], fx, fake_model.rope_cache[:16], mode=m)
                for m in ("none", "full", "op")}
    assert fake == real
    with torch.device("meta"):
        meta_model = Llama3(model.args)
        mx = torch.randn(x.shape, requires_grad=True)
    # On meta, SDPA takes the math path, so `none` differs; full and op do not depend on it here.
    assert saved_activation_bytes(meta_model.layers["1"], mx, meta_model.rope_cache[:16], mode="full") == real["full"]
    assert saved_activation_bytes(meta_model.layers["1"], mx, meta_model.rope_cache[:16], mode="none") > real["full"]


def test_force_recompute_saves_less():
    model = seeded_llama("debug_small")
    x, rope = block_inputs(model)
    block = model.layers["0"]
    plain = saved_activation_bytes(block, x, rope, mode="op")
    forced = saved_activation_bytes(block, x, rope, mode="op",
                                    cfg=ActivationCheckpointConfig(force_recompute_mm_fqns=["attention.w*"]))
    a = model.args
    tokens = x.shape[0] * x.shape[1]
    # wq, wk, wv, wo are forced out of the count: the FFN's w1, w3, w2 then alternate as
    # save, recompute, save -- the same saved shapes as before minus wv's output (v). wq's
    # is not kept in either: the recompute plan keeps q after RoPE, so nothing reads it.
    assert plain - forced == a.kv_heads * a.head_dim * tokens * 4
    # The temporary registration for this count is removed (other tests' models may still be registered).
    assert not any(m in ac_sac._FORCED_MODULES for m in block.modules())


# --------------------------------------------------------------------------- costs


def _costs(base, mode, tokens, early_stop=True):
    from torch.utils.checkpoint import set_checkpoint_early_stop
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=mode))
    exclude = list(model.parameters()) + list(model.buffers())
    with set_checkpoint_early_stop(early_stop):
        with flop_counter() as fwd, SavedActivationCounter(exclude) as saved:
            loss = model(tokens).float().logsumexp(-1).mean()
        with flop_counter() as bwd:
            loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops(), saved.total_bytes


def test_cost_ordering_on_debug_model():
    base = seeded_llama("debug")
    a = base.args
    b, s = 1, 64
    tokens = torch.randint(0, a.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    costs = {m: _costs(base, m, tokens) for m in MODES}
    fwd = costs["none"][0]
    assert all(c[0] == fwd for c in costs.values())
    # Recompute FLOPs = backward-phase FLOPs minus those of `none` (the backward ops
    # themselves are the same in every mode).
    recompute = {m: costs[m][1] - costs["none"][1] for m in MODES}
    block_fwd = fwd - 2 * b * s * a.dim * a.vocab_size  # everything but the output head
    # Non-reentrant checkpoint stops the recompute once every tensor backward needs is
    # back: the block's last matmul (w2, whose output backward never reads) is skipped.
    w2 = 2 * b * s * a.dim * a.ffn_hidden_dim
    assert recompute["none"] == 0
    assert recompute["full"] == block_fwd - a.n_layers * w2
    assert recompute["selective"] == (block_fwd - a.n_layers * w2) // 2  # 3 of 6 blocks (ids 0, 2, 4)
    assert 0 < recompute["op"] < recompute["full"]
    # Without early stop, full recomputes exactly one forward of the checkpointed blocks.
    full_no_stop = _costs(base, "full", tokens, early_stop=False)
    assert full_no_stop[1] - costs["none"][1] == block_fwd
    saved = {m: costs[m][2] for m in MODES}
    assert saved["none"] > saved["op"] and saved["none"] > saved["selective"] > saved["full"]
    assert saved["op"] <= 0.6 * saved["none"]


def test_flop_counter_counts_cpu_attention():
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with flop_counter() as fc:
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.sum().backward()
    counts = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    assert counts["aten._scaled_dot_product_flash_attention_for_cpu"] == 2 * 2 * 2 * 8 * 8 * 4
    assert counts["aten._scaled_dot_product_flash_attention_for_cpu_backward"] == 5 * 2 * 2 * 8 * 8 * 4


# --------------------------------------------------------------------------- trace


def _trace_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "ac" and r.getMessage().startswith("AC_TRACE")]


def test_trace_logs_each_op_once_with_its_verdict(monkeypatch, caplog):
    monkeypatch.setenv("AC_TRACE", "1")
    reset_ac_trace()
    model = seeded_llama("debug_small")
    apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="op", force_recompute_mm_fqns=["*.w3"]))
    tokens = torch.randint(0, 2048, (2, 16))
    with caplog.at_level(logging.INFO, logger="ac"):
        for _ in range(2):
            model(tokens).sum().backward()
    lines = _trace_lines(caplog)
    assert len(lines) == len(set(lines))
    # One PLAN line per block (the recompute plan, recorded at its first call).
    plans = [line for line in lines if line.split()[1] == "PLAN"]
    assert [p.split()[2] for p in plans] == [f"layers.{i}:" for i in range(len(model.layers))]
    assert "aten.add.Tensor#0, aten.add.Tensor#1, aten.rsqrt.default#0, aten.rsqrt.default#1" in plans[0]
    lines = [line for line in lines if line not in plans]
    ops = [line.split()[2] for line in lines]
    assert len(ops) == len(set(ops)) + 1  # only aten.mm appears twice: ALTERNATE and forced RECOMPUTE
    assert "AC_TRACE ALTERNATE aten.mm.default" in lines
    assert "AC_TRACE SAVE aten._scaled_dot_product_flash_attention_for_cpu.default" in lines
    assert "AC_TRACE RECOMPUTE aten.silu.default" in lines
    assert "AC_TRACE RECOMPUTE aten.mm.default (force_recompute_mm_fqns: layers.0.feed_forward.w3)" in lines
    verdicts = {line.split()[1] for line in lines}
    assert verdicts == {"SAVE", "RECOMPUTE", "ALTERNATE"}


def test_trace_is_off_by_default(monkeypatch, caplog):
    monkeypatch.delenv("AC_TRACE", raising=False)
    reset_ac_trace()
    model = seeded_llama("debug_small")
    apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="op"))
    with caplog.at_level(logging.INFO, logger="ac"):
        model(torch.randint(0, 2048, (1, 8))).sum().backward()
    assert _trace_lines(caplog) == []


# --------------------------------------------------------------------------- checkpoints


def test_state_dict_keys_are_the_same_in_every_mode():
    base = seeded_llama("debug_small")
    keys = list(base.state_dict().keys())
    models = {}
    for mode in MODES:
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=mode))
        assert list(model.state_dict().keys()) == keys, mode
        assert not any(PREFIX in k for k in model.state_dict())
        models[mode] = model
    # A checkpoint saved under one mode loads strictly under any other.
    for src in MODES:
        for dst in MODES:
            fresh = seeded_llama("debug_small", seed=99)
            apply_activation_checkpointing(fresh, ActivationCheckpointConfig(mode=dst))
            fresh.load_state_dict(models[src].state_dict(), strict=True)
            for k, v in fresh.state_dict().items():
                assert torch.equal(v, base.state_dict()[k])


def test_flop_counter_counts_grouped_mm():
    e, t, k, n = 4, 64, 32, 48
    x = torch.randn(t, k, requires_grad=True)
    w = torch.randn(e, k, n, requires_grad=True)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    with flop_counter() as fwd:
        y = torch._grouped_mm(x, w, offs=offs)
    with flop_counter() as bwd:
        y.backward(torch.randn(t, n))  # grad x: [T,N]x[E,N,K]; grad w: [K,T]x[T,N]
    assert fwd.get_total_flops() == 2 * t * k * n
    assert bwd.get_total_flops() == 2 * (2 * t * k * n)


def test_trace_only_on_rank_zero(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setenv("AC_TRACE", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    assert ac_trace.trace_enabled() is False
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    assert ac_trace.trace_enabled() is True
    monkeypatch.setenv("AC_TRACE", "0")
    assert ac_trace.trace_enabled() is False


def test_apply_compile_targets_the_wrapper_and_sets_globals(monkeypatch):
    """Structure only: nn.Module.compile is lazy, so nothing is compiled here."""
    import torch._functorch.config as functorch_config

    from parallelisms.compile import CompileConfig, apply_compile
    calls = []
    monkeypatch.setattr(torch._C._dynamo.eval_frame, "_set_lru_cache", lambda flag: calls.append(flag))
    monkeypatch.setattr(functorch_config, "activation_memory_budget", functorch_config.activation_memory_budget)

    model = seeded_llama()
    keys = list(model.state_dict())
    cfg = ActivationCheckpointConfig(mode="op")
    apply_activation_checkpointing(model, cfg, compile_enabled=True)
    apply_compile(model, CompileConfig(enable=True), cfg)
    assert calls == [False]  # dynamo's LRU cache disabled with SAC
    for wrapper in model.layers.values():
        assert wrapper._compiled_call_impl is not None  # compiled from outside the SAC wrapper
        assert wrapper._checkpoint_wrapped_module._compiled_call_impl is None
    assert list(model.state_dict()) == keys

    model = seeded_llama()
    cfg = ActivationCheckpointConfig(mode="memory_budget", memory_budget=0.25)
    apply_activation_checkpointing(model, cfg, compile_enabled=True)
    apply_compile(model, CompileConfig(enable=True), cfg)
    assert functorch_config.activation_memory_budget == 0.25
    assert all(b._compiled_call_impl is not None for b in model.layers.values())

    untouched = seeded_llama()
    apply_compile(untouched, CompileConfig(enable=False), ActivationCheckpointConfig(mode="full"))
    assert all(b._compiled_call_impl is None for b in untouched.layers.values())


def test_moe_policy_decisions():
    """DeepSeek's op-level rules on a MoE block: the gate GEMM kept, the up GEMM recomputed,
    the down GEMM kept (1 rank) or, under EP, skipped with the index_select that reads its
    output (the kept combine all-to-all is all that reads them); an index_select of other
    data is not skipped; bmm recomputed; dense blocks unchanged."""
    from models.deepseek_v3.ac import MoEOpSAC
    from parallelisms.ac_sac import OpSACPolicy
    rules = MoEOpSAC(ActivationCheckpointConfig(mode="op"))
    g, ix = aten._grouped_mm.default, aten.index_select.default
    S, R = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE

    def run(info):
        # (op, input, output): the down GEMM's output d is what the second index_select reads
        # (through a view, as the experts' view_as); the first and last read other tensors.
        x, d, other = torch.ones(4, 2), torch.ones(4, 2), torch.ones(4, 2)
        ops = [(ix, x, x[:2]), (g, x, x), (g, x, x), (g, x, d), (ix, d.view_as(d), torch.ones(4, 2)),
               (aten.bmm.default, x, x), (aten.topk.default, x, x), (g, x, x), (g, x, x), (g, x, other),
               (ix, x, x)]
        call = OpSACPolicy(rules.save_ops(), explicit_save_ops=rules.explicit_save_ops(), rules=rules, info=info)
        counts: dict = {}
        verdicts = []
        for op, inp, out in ops:
            call.index = counts.get(op, 0)  # (its invocation index, as the caching mode passes it)
            counts[op] = call.index + 1
            policy, verdict, _ = call.decide(op, False, (inp, None), out)
            verdicts.append((policy, verdict))
        return verdicts

    assert run({"moe": True, "ep": True}) == [
        (R, "RECOMPUTE"), (S, "SAVE"), (R, "RECOMPUTE"), (R, "SKIP"), (R, "SKIP"), (R, "RECOMPUTE"), (S, "SAVE"),
        (S, "SAVE"), (R, "RECOMPUTE"), (R, "SKIP"), (R, "RECOMPUTE")]
    assert run({"moe": True, "ep": False}) == [
        (R, "RECOMPUTE"), (S, "SAVE"), (R, "RECOMPUTE"), (S, "SAVE"), (R, "RECOMPUTE"), (R, "RECOMPUTE"), (S, "SAVE"),
        (S, "SAVE"), (R, "RECOMPUTE"), (S, "SAVE"), (R, "RECOMPUTE")]
    # A dense block: the default rules (grouped GEMMs alternate like every matmul, bmm is saved).
    assert run({"moe": False})[1:4] == [(S, "ALTERNATE"), (R, "ALTERNATE"), (S, "ALTERNATE")]
    assert run({"moe": False})[5] == (S, "SAVE")
