"""Activation checkpointing: config routing, the op-level policy, bitwise numerics,
costs (FLOPs and saved bytes), the AC_TRACE diagnostics and state-dict stability.

Everything here is single-process and fp32 on CPU. Multi-rank FSDP2 runs are in
test_ac_multirank.py, torch.compile in test_ac_compile.py.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

from models.llama3 import LLAMA3_FLAVORS, Llama3
from parallelisms import ac_ops, ac_sac, ac_trace
from parallelisms.ac_measure import SavedActivationCounter, flop_counter, saved_activation_bytes
from parallelisms.activation_checkpoint import (
    MATMUL_OPS,
    ActivationCheckpointConfig,
    OpSAC,
    OpSACPolicy,
    apply_activation_checkpointing,
    default_save_ops,
    op_sac_context_fn,
    reset_ac_trace,
)
from trainer.config import load_config
from configuration.fields import ConfigError

aten = torch.ops.aten
MODES = ("none", "full", "selective", "op")
PREFIX = "_checkpoint_wrapped_module."


def _clean(name: str) -> str:
    return name.replace(PREFIX, "")


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("value,expected", [
    ("true", "full"), ("false", "none"), ("True", "full"), ("full", "full"), ("none", "none"),
    ("selective", "selective"), ("op", "op"),
])
def test_config_mode_routing_cli(value, expected):
    cfg = load_config(["--activation_checkpoint.mode", value])
    assert cfg.activation_checkpoint.mode == expected


@pytest.mark.parametrize("toml_value,expected", [("true", "full"), ("false", "none"), ('"op"', "op")])
def test_config_mode_routing_toml(tmp_path, toml_value, expected):
    path = tmp_path / "ac.toml"
    path.write_text(f"[activation_checkpoint]\nmode = {toml_value}\nselective_layer_interval = 3\n")
    cfg = load_config(["--config", str(path)])
    assert cfg.activation_checkpoint.mode == expected
    assert cfg.activation_checkpoint.selective_layer_interval == 3


def test_config_memory_budget_with_compile():
    cfg = load_config(["--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget",
                       "0.3", "--compile.enable", "true", "--activation_checkpoint.force_recompute_mm_fqns",
                       "*.gate,moe.router*"])
    ac_cfg = cfg.activation_checkpoint
    assert (ac_cfg.mode, ac_cfg.memory_budget) == ("memory_budget", 0.3)
    assert ac_cfg.force_recompute_mm_fqns == ["*.gate", "moe.router*"]
    assert ac_cfg.preserve_rng_state is True


@pytest.mark.parametrize("args,needle", [
    (["--activation_checkpoint.mode", "sellective"], "did you mean 'selective'"),
    (["--activation_checkpoint.mode", "bogus"], "none, full, selective, op, memory_budget"),
    (["--activation_checkpoint.selective_layer_interval", "0"], "below the minimum 1"),
    (["--activation_checkpoint.memory_budget", "1.5"], "above the maximum 1.0"),
    (["--activation_checkpoint.memory_budget", "-0.1"], "below the minimum 0.0"),
    (["--activation_checkpoint.mode", "memory_budget"], "memory_budget needs compile"),
    (["--activation_checkpoint.preserve_rng_state", "maybe"], "expected bool"),
])
def test_config_errors_are_one_line(args, needle):
    with pytest.raises(ConfigError) as e:
        load_config(args)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and msg.startswith("config error: activation_checkpoint.")


def _llama(flavor="debug_small", seed=0, **overrides):
    torch.manual_seed(seed)
    args = dataclasses.replace(LLAMA3_FLAVORS[flavor], **overrides)
    model = Llama3(args)
    model.init_weights()
    return model


def test_apply_rejects_bad_configs_built_in_code():
    model = _llama()
    with pytest.raises(ValueError, match="memory_budget needs compile"):
        apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="memory_budget"), compile_enabled=False)
    with pytest.raises(ValueError, match="not one of"):
        apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="sometimes"))
    with pytest.raises(ValueError, match="minimum 1"):
        apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="selective", selective_layer_interval=0))
    with pytest.raises(ValueError, match="above the maximum 1.0"):
        apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="memory_budget", memory_budget=2.0),
                                       compile_enabled=True)
    with pytest.raises(TypeError, match="model.layers"):
        apply_activation_checkpointing(nn.Linear(2, 2), ActivationCheckpointConfig(mode="full"))
    assert all(not hasattr(b, "_ac_mode") for b in model.layers.values())


@pytest.mark.parametrize("mode,interval,expected", [
    ("none", 2, {}),
    (True, 2, {"0": "full", "1": "full", "2": "full"}),
    ("full", 2, {"0": "full", "1": "full", "2": "full"}),
    ("selective", 2, {"0": "full", "2": "full"}),
    ("selective", 1, {"0": "full", "1": "full", "2": "full"}),
    ("selective", 3, {"0": "full"}),
    ("op", 2, {"0": "op", "1": "op", "2": "op"}),
    ("memory_budget", 2, {}),
])
def test_apply_routing_wraps_the_right_blocks(mode, interval, expected):
    model = _llama()
    cfg = ActivationCheckpointConfig(mode=mode, selective_layer_interval=interval)
    apply_activation_checkpointing(model, cfg, compile_enabled=True)
    got = {k: b._ac_mode for k, b in model.layers.items() if hasattr(b, "_ac_mode")}
    assert got == expected
    for k, b in model.layers.items():
        if k in expected:
            assert b.checkpoint_fn.keywords["preserve_rng_state"] is True
            assert ("context_fn" in b.checkpoint_fn.keywords) == (expected[k] == "op")


def test_apply_twice_is_an_error():
    model = _llama()
    apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="full"))
    with pytest.raises(RuntimeError, match="already"):
        apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="op"))


# --------------------------------------------------------------------------- the policy


class _Ctx:
    """Stand-in SelectiveCheckpointContext as older torch passes it (no op_output)."""

    def __init__(self, is_recompute: bool):
        self.is_recompute = is_recompute


# One block with 3 matmuls (odd): attention-ish then a 3rd projection.
_BLOCK_OPS = [aten.mm.default, aten.add.Tensor, aten.mm.default,
              aten._scaled_dot_product_flash_attention_for_cpu.default, aten.silu.default, aten.mm.default,
              aten.topk.default, aten.view.default]


def _decisions(policy, is_recompute):
    return [policy(_Ctx(is_recompute), op) for op in _BLOCK_OPS]


def _policy(save_ops, **kwargs) -> OpSACPolicy:
    """One call's policy function under the default op-level rules."""
    return OpSACPolicy(save_ops, rules=OpSAC(ActivationCheckpointConfig(mode="op")), **kwargs)


class _OneCounter(dict):
    """The bug the design note warns about: one matmul counter for both passes."""

    def __getitem__(self, is_recompute):
        return super().get(False, 0)

    def __setitem__(self, is_recompute, value):
        super().__setitem__(False, value)


def test_policy_forward_and_recompute_agree_with_odd_matmul_count():
    policy = _policy(default_save_ops())
    fwd = _decisions(policy, False)
    rec = _decisions(policy, True)
    assert fwd == rec
    S, R = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert fwd == [S, R, R, S, R, S, S, R]  # mm save, mm recompute, sdpa save, silu recompute, mm save, topk save
    assert policy.mm_count == {False: 3, True: 3}

    # The shared-counter variant starts the recompute with the wrong parity.
    shared = _policy(default_save_ops())
    shared.mm_count = _OneCounter()
    s_fwd, s_rec = _decisions(shared, False), _decisions(shared, True)
    assert s_fwd == fwd
    assert s_rec != s_fwd
    assert [d for op, d in zip(_BLOCK_OPS, s_rec) if op == aten.mm.default] == [R, S, R]


def test_policy_counts_reset_per_block_call():
    context_fn = op_sac_context_fn()
    first, _ = context_fn()
    second, _ = context_fn()
    assert isinstance(first.policy_fn, OpSACPolicy) and first.policy_fn is not second.policy_fn
    decisions = [_decisions(context_fn()[0].policy_fn, False) for _ in range(3)]
    assert decisions[0] == decisions[1] == decisions[2]


def test_even_matmul_count_alternates():
    policy = _policy(default_save_ops())
    got = [policy(_Ctx(False), aten.mm.default) for _ in range(4)]
    S, R = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert got == [S, R, S, R]


def test_grouped_and_linear_matmuls_alternate_too():
    names = {str(op) for op in MATMUL_OPS}
    assert {"aten.mm", "aten.linear", "aten._grouped_mm"} <= names
    policy = _policy(default_save_ops())
    ops = [aten.mm.default, aten._grouped_mm.default, aten.linear.default, aten._grouped_mm.default]
    S, R = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert [policy(_Ctx(False), op) for op in ops] == [S, R, S, R]


def test_spec_listed_matmul_is_saved_not_alternated():
    policy = _policy(default_save_ops({aten._grouped_mm.default}), explicit_save_ops={aten._grouped_mm.default})
    S, R = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    ops = [aten._grouped_mm.default, aten.mm.default, aten._grouped_mm.default, aten.mm.default]
    assert [policy(_Ctx(False), op) for op in ops] == [S, S, S, R]  # grouped: always; mm alternates alone
    assert policy.decide(aten._grouped_mm.default, False)[1:] == ("SAVE", "model spec")


def _lookup(ns, name):
    return ac_ops.lookup(ns, name)


def test_save_set_contents():
    save = default_save_ops()
    must = [aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
            aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention, aten.topk,
            aten.addmm, aten.bmm]
    for name in ("reduce_scatter_tensor", "all_to_all_single", "all_gather_into_tensor"):
        must.append(_lookup("_c10d_functional", name))
    for op in must:
        assert op is not None and op in save, op
    hop = ac_ops.compiled_region_hop()
    assert hop is not None and hop in save
    assert not (MATMUL_OPS & save)
    # Seeded from the partitioner: everything it lists (bar the alternating matmuls) is saved.
    from torch._functorch.partitioners import get_default_op_list
    assert {ac_ops.op_key(o) for o in get_default_op_list().compute_intensive_ops} - MATMUL_OPS <= save
    # A model spec can add ops.
    assert aten.sort in default_save_ops({aten.sort.stable})


def test_save_set_falls_back_when_partitioner_api_is_missing(monkeypatch):
    import torch._functorch.partitioners as partitioners

    def broken():
        raise AttributeError("moved")

    monkeypatch.setattr(partitioners, "get_default_op_list", broken)
    assert ac_ops.partitioner_compute_ops() == set()
    fallback = ac_ops._base_save_ops.__wrapped__(True)
    assert aten._scaled_dot_product_flash_attention_for_cpu in fallback and aten.addmm in fallback
    assert aten.mm not in fallback


def test_runtime_ops_are_never_saved():
    import torch.distributed.fsdp  # noqa: F401 - registers torch.ops.fsdp.*
    policy = _policy(default_save_ops({torch.ops.fsdp.all_gather_copy_in.default}))
    for op in (torch.ops.fsdp.all_gather_copy_in.default, torch.ops.fsdp.split_with_sizes_copy.default,
               torch.ops.profiler._record_function_enter_new.default,
               torch.ops.profiler._record_function_exit._RecordFunction):
        assert policy(_Ctx(False), op) == CheckpointPolicy.PREFER_RECOMPUTE


def test_device_to_host_copies_are_saved():
    from torch._subclasses.fake_tensor import FakeTensorMode
    policy = _policy(default_save_ops())
    with FakeTensorMode():
        dev = torch.empty(4, device="cuda")
        host = dev.to("cpu")
        assert policy.decide(aten._to_copy.default, False, (dev,), host)[0] == CheckpointPolicy.MUST_SAVE
        assert policy.decide(aten._local_scalar_dense.default, False, (dev,), 3)[0] == CheckpointPolicy.MUST_SAVE
        h2d = torch.empty(4, device="cuda")  # a host-to-device copy's output
        assert policy.decide(aten._to_copy.default, False, (host,), h2d)[0] == CheckpointPolicy.PREFER_RECOMPUTE
    cpu = torch.ones(2)
    assert policy.decide(aten._to_copy.default, False, (cpu,), cpu.double())[0] == CheckpointPolicy.PREFER_RECOMPUTE


class _RecordOnlyInRecompute(nn.Module):
    """Runs a profiler record_function only when `self.extra` is set, i.e. in one pass only."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)
        self.extra = False

    def forward(self, x):
        if self.extra:
            with torch.profiler.record_function("only-in-recompute"):
                pass
        return self.lin(x).relu()


def test_runtime_op_in_one_pass_only_bypasses_the_cache():
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    mod = _RecordOnlyInRecompute()
    ref = torch.autograd.grad(mod(x).sum(), [x, mod.lin.weight])

    out = checkpoint(mod, x, use_reentrant=False, context_fn=op_sac_context_fn())
    mod.extra = True
    got = torch.autograd.grad(out.sum(), [x, mod.lin.weight])
    assert all(torch.equal(a, b) for a, b in zip(ref, got))

    # Without the bypass, torch's own SAC cache rejects the extra ops.
    mod.extra = False
    out = checkpoint(mod, x, use_reentrant=False,
                     context_fn=lambda: create_selective_checkpoint_contexts(_policy(default_save_ops())))
    mod.extra = True
    with pytest.raises(RuntimeError, match="not found in storage"):
        torch.autograd.grad(out.sum(), [x])


# --------------------------------------------------------------------------- numerics


def _train(model, batches, steps=2):
    """Loss and every parameter grad (keyed without wrapper prefixes) for each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    record = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        inputs, target = batches[step]
        out = model(inputs)
        loss = F.cross_entropy(out.flatten(0, -2), target.flatten()) if target.dtype == torch.long \
            else F.mse_loss(out, target)
        loss.backward()
        record.append((loss.detach().clone(), {_clean(n): p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return record


def _assert_bitwise(ref, got):
    for (l_ref, g_ref), (l_got, g_got) in zip(ref, got):
        assert torch.equal(l_ref, l_got), (l_ref.item(), l_got.item())
        assert g_ref.keys() == g_got.keys()
        for name in g_ref:
            assert torch.equal(g_ref[name], g_got[name]), name


def _run_mode(base, mode, batches, **kwargs):
    model = copy.deepcopy(base)
    cfg = ActivationCheckpointConfig(mode=mode, **kwargs.pop("cfg", {}))
    apply_activation_checkpointing(model, cfg, **kwargs)
    torch.manual_seed(1234)  # same RNG stream for dropout in every mode
    return _train(model, batches)


@pytest.fixture(scope="module")
def llama_runs():
    base = _llama("debug_small")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 2048, (2, 32), generator=g), torch.randint(0, 2048, (2, 32), generator=g))
               for _ in range(2)]
    return {mode: _run_mode(base, mode, batches) for mode in MODES}, base, batches


@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_llama_bitwise_equal_to_none(llama_runs, mode):
    runs, _, _ = llama_runs
    _assert_bitwise(runs["none"], runs[mode])


def test_llama_op_with_forced_recompute_is_bitwise(llama_runs):
    runs, base, batches = llama_runs
    got = _run_mode(base, "op", batches, cfg={"force_recompute_mm_fqns": ["feed_forward.w3"]},
                    force_recompute_fqns=("layers.1.attention.wk",))
    _assert_bitwise(runs["none"], got)


class _SquareBlock(nn.Module):
    """n same-shaped square linears with GELU and dropout between them: the shape agreement
    that lets a wrong matmul parity go unnoticed, and dropout to check the RNG replay."""

    def __init__(self, dim: int, n: int, p: float = 0.1):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(n))
        self.p = p

    def forward(self, x):
        h = x
        for lin in self.lins:
            h = F.dropout(F.gelu(lin(h)), self.p, self.training)
        return x + h


class _Toy(nn.Module):
    def __init__(self, dim=16, n_linears=3, n_layers=3):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _SquareBlock(dim, n_linears) for i in range(n_layers)})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x


@pytest.mark.parametrize("n_linears", [3, 4])
def test_toy_square_linears_bitwise_with_dropout(n_linears):
    torch.manual_seed(0)
    base = _Toy(n_linears=n_linears)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g)) for _ in range(2)]
    ref = _run_mode(base, "none", batches)
    for mode in ("full", "selective", "op"):
        _assert_bitwise(ref, _run_mode(base, mode, batches))


def test_toy_odd_matmuls_policy_state_shared_across_calls_changes_decisions():
    # A policy whose counter is not reset per call saves different matmuls on the next
    # call of the same block; ours starts every call from zero.
    shared = _policy(default_save_ops())
    first = [shared(_Ctx(False), aten.mm.default) for _ in range(3)]
    second = [shared(_Ctx(False), aten.mm.default) for _ in range(3)]
    assert first != second
    fresh = op_sac_context_fn()
    assert [fresh()[0].policy_fn(_Ctx(False), aten.mm.default) for _ in range(3)] == [first[0]] * 3


def _tiny_deepseek():
    from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3
    args = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debug"], dim=64, n_layers=2, n_dense_layers=1, inter_dim=128,
                               moe_inter_dim=32, n_heads=4, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
                               qk_rope_head_dim=8, v_head_dim=16, vocab_size=256, max_seq_len=64)
    torch.manual_seed(0)
    model = DeepSeekV3(args)
    model.init_weights()
    return model


def test_moe_blocks_bitwise_with_spec_ops():
    from models.deepseek_v3 import spec
    base = _tiny_deepseek()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
               for _ in range(2)]
    ref = _run_mode(base, "none", batches)
    for mode in ("full", "op"):
        got = _run_mode(base, mode, batches, spec=spec)
        _assert_bitwise(ref, got)


# --------------------------------------------------------------------------- saved bytes


def _block_inputs(model, batch=2, seq=16):
    torch.manual_seed(5)
    x = torch.randn(batch, seq, model.args.dim, requires_grad=True)
    return x, model.rope_cache[:seq]


@pytest.mark.parametrize("flavor", ["debug_small", "debug"])
def test_saved_bytes_match_analytic_counts(flavor):
    model = _llama(flavor)
    a = model.args
    x, rope = _block_inputs(model)
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
    model = _llama("debug_small")
    x, rope = _block_inputs(model)
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
    model = _llama("debug_small")
    x, rope = _block_inputs(model)
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
    base = _llama("debug")
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
    model = _llama("debug_small")
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
    model = _llama("debug_small")
    apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="op"))
    with caplog.at_level(logging.INFO, logger="ac"):
        model(torch.randint(0, 2048, (1, 8))).sum().backward()
    assert _trace_lines(caplog) == []


# --------------------------------------------------------------------------- checkpoints


def test_state_dict_keys_are_the_same_in_every_mode():
    base = _llama("debug_small")
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
            fresh = _llama("debug_small", seed=99)
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

    model = _llama()
    keys = list(model.state_dict())
    cfg = ActivationCheckpointConfig(mode="op")
    apply_activation_checkpointing(model, cfg, compile_enabled=True)
    apply_compile(model, CompileConfig(enable=True), cfg)
    assert calls == [False]  # dynamo's LRU cache disabled with SAC
    for wrapper in model.layers.values():
        assert wrapper._compiled_call_impl is not None  # compiled from outside the SAC wrapper
        assert wrapper._checkpoint_wrapped_module._compiled_call_impl is None
    assert list(model.state_dict()) == keys

    model = _llama()
    cfg = ActivationCheckpointConfig(mode="memory_budget", memory_budget=0.25)
    apply_activation_checkpointing(model, cfg, compile_enabled=True)
    apply_compile(model, CompileConfig(enable=True), cfg)
    assert functorch_config.activation_memory_budget == 0.25
    assert all(b._compiled_call_impl is not None for b in model.layers.values())

    untouched = _llama()
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
