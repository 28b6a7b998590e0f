"""Activation checkpointing: config routing, the op-level policy and bitwise numerics.

Everything here is single-process and fp32 on CPU. Costs (FLOPs and saved bytes), the
AC_TRACE diagnostics and state-dict stability are in test_ac_costs.py; multi-rank FSDP2
runs in test_ac_multirank.py, torch.compile in test_ac_compile.py.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

from parallelisms import ac_ops
from parallelisms.activation_checkpoint import (
    MATMUL_OPS,
    ActivationCheckpointConfig,
    OpSAC,
    OpSACPolicy,
    apply_activation_checkpointing,
    default_save_ops,
    op_sac_context_fn,
)
from tests.ac_helpers import assert_bitwise, run_mode, seeded_llama, tiny_deepseek
from trainer.config import load_config
from configuration.fields import ConfigError

aten = torch.ops.aten
MODES = ("none", "full", "selective", "op")


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


def test_apply_rejects_bad_configs_built_in_code():
    model = seeded_llama()
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
    model = seeded_llama()
    cfg = ActivationCheckpointConfig(mode=mode, selective_layer_interval=interval)
    apply_activation_checkpointing(model, cfg, compile_enabled=True)
    got = {k: b._ac_mode for k, b in model.layers.items() if hasattr(b, "_ac_mode")}
    assert got == expected
    for k, b in model.layers.items():
        if k in expected:
            assert b.checkpoint_fn.keywords["preserve_rng_state"] is True
            assert ("context_fn" in b.checkpoint_fn.keywords) == (expected[k] == "op")


def test_apply_twice_is_an_error():
    model = seeded_llama()
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








@pytest.fixture(scope="module")
def llama_runs():
    base = seeded_llama("debug_small")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 2048, (2, 32), generator=g), torch.randint(0, 2048, (2, 32), generator=g))
               for _ in range(2)]
    return {mode: run_mode(base, mode, batches) for mode in MODES}, base, batches


@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_llama_bitwise_equal_to_none(llama_runs, mode):
    runs, _, _ = llama_runs
    assert_bitwise(runs["none"], runs[mode])


def test_llama_op_with_forced_recompute_is_bitwise(llama_runs):
    runs, base, batches = llama_runs
    got = run_mode(base, "op", batches, cfg={"force_recompute_mm_fqns": ["feed_forward.w3"]},
                    force_recompute_fqns=("layers.1.attention.wk",))
    assert_bitwise(runs["none"], got)


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
    ref = run_mode(base, "none", batches)
    for mode in ("full", "selective", "op"):
        assert_bitwise(ref, run_mode(base, mode, batches))


def test_toy_odd_matmuls_policy_state_shared_across_calls_changes_decisions():
    # A policy whose counter is not reset per call saves different matmuls on the next
    # call of the same block; ours starts every call from zero.
    shared = _policy(default_save_ops())
    first = [shared(_Ctx(False), aten.mm.default) for _ in range(3)]
    second = [shared(_Ctx(False), aten.mm.default) for _ in range(3)]
    assert first != second
    fresh = op_sac_context_fn()
    assert [fresh()[0].policy_fn(_Ctx(False), aten.mm.default) for _ in range(3)] == [first[0]] * 3




def test_moe_blocks_bitwise_with_spec_ops():
    from models.deepseek_v3 import spec
    base = tiny_deepseek()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
               for _ in range(2)]
    ref = run_mode(base, "none", batches)
    for mode in ("full", "op"):
        got = run_mode(base, mode, batches, spec=spec)
        assert_bitwise(ref, got)
