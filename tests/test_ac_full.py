"""`full` on the direct machinery (parallelisms/ac_full.py): from a block's third call its
recompute runs the recorded aten ops, not torch's re-run of the block, and it holds what
torch's checkpoint holds; where that is unsafe, torch's checkpoint runs. Bitwise against
no checkpointing throughout."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn as nn
from torch.utils import checkpoint as torch_checkpoint

from parallelisms.ac_full import FullAC, FullCall
from parallelisms.activation_checkpoint import ActivationCheckpointConfig, apply_activation_checkpointing
from tests.test_ac_dce import _assert_equal, _Gated, _grads, forward_dispatches, gated_calls  # noqa: F401 (a fixture)

aten = torch.ops.aten


@pytest.fixture
def block_reruns(monkeypatch):
    """Counts torch's checkpoint re-running a block's forward (its recompute)."""
    count = collections.Counter()
    real = torch_checkpoint._run_fn_with_dynamo_disabled

    def run(fn, *args):
        count["reruns"] += 1
        return real(fn, *args)

    monkeypatch.setattr(torch_checkpoint, "_run_fn_with_dynamo_disabled", run)
    return count


@pytest.fixture
def full_calls(monkeypatch):
    """Every `FullCall` whose forward ended, with the tensors it still holds then."""
    calls = []
    real = FullCall.__exit__

    def exit_(self, *exc):
        slots = self.slots
        out = real(self, *exc)
        calls.append((self, [s.x for s in slots if isinstance(s.x, torch.Tensor)]))
        return out

    monkeypatch.setattr(FullCall, "__exit__", exit_)
    return calls


def _held_bytes(tensors, outside) -> int:
    """Bytes of the distinct storages among `tensors` that are not in `outside` (weights, RoPE)."""
    skip = {t.untyped_storage().data_ptr() for t in outside}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in storages.items() if ptr not in skip)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_full_recompute_runs_without_rerunning_the_block_from_the_third_step(mode, forward_dispatches, block_reruns,
                                                                              full_calls):
    """Steps 1 and 2 record each block and build its direct recompute (torch's checkpoint
    re-runs every checkpointed block then). From step 3 no op goes through a dispatch
    mode, torch's checkpoint never re-runs a block, and each checkpointed block holds
    after its forward only its input (beyond weights and the RoPE table): what torch's
    checkpoint holds. Loss and gradients equal `none`'s bitwise at every step."""
    from parallelisms.ac_measure import saved_activation_bytes
    from tests.ac_helpers import block_inputs, seeded_llama, token_batches, train_against_none
    base = seeded_llama("debug_small")
    seen = []

    def clear():
        forward_dispatches.clear()
        block_reruns.clear()
        full_calls.clear()

    policy, model = train_against_none(base, mode, token_batches(4), before=clear, after_backward=lambda: seen.append(
        (sum(forward_dispatches.values()), block_reruns["reruns"], list(full_calls))))
    checkpointed = 3 if mode == "full" else 2  # (selective every 2: layers 0 and 2 of 3)
    assert isinstance(policy, FullAC) and len(policy.plans) == checkpointed
    (d1, r1, c1), (d2, r2, c2), (d3, r3, c3), (d4, r4, c4) = seen[4:]
    assert d1 > 0 and d2 > 0 and r1 == r2 == checkpointed and not c1 and not c2
    assert d3 == d4 == 0 and r3 == r4 == 0 and len(c3) == len(c4) == checkpointed
    outside = [*model.parameters(), *model.buffers()]  # (the checkpointed run's weights and RoPE table)
    x, rope = block_inputs(base, batch=2, seq=16)
    torch_holds = saved_activation_bytes(base.layers["0"], x, rope, mode="full")
    assert torch_holds == x.nbytes
    for call, held in c3 + c4:
        assert not call.fell_back and _held_bytes(held, outside) == torch_holds
    steps = [[str(op) for op, *_ in p.direct.steps] for p in policy.plans.values()]
    assert steps[0].count("aten.mm.default") == 6  # wq wk wv wo w1 w3 (not w2: backward never reads its output)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in steps[0]


def test_full_falls_back_to_torchs_recompute_when_a_calls_packs_differ(forward_dispatches, block_reruns, full_calls):
    """Call 4 takes another branch, so its packs differ from the recorded ones: it holds no
    pack either (torch's checkpoint re-runs the block in its backward, as before), and the
    block stays on torch's checkpoint. Bitwise every call."""
    policy = FullAC(ActivationCheckpointConfig(mode="full"))
    for call, plan, block, x in gated_calls(policy, (False, False, False, True, False), forward_dispatches,
                                            block_reruns, full_calls):
        if call == 3:
            assert [str(op) for op, *_ in plan.direct.steps] == ["aten.mm.default", "aten.silu.default",
                                                                   "aten.mm.default", "aten.mul.Tensor"]
            (done, held), = full_calls
            assert block_reruns["reruns"] == 0 and [t.untyped_storage().data_ptr() for t in held] != []
            assert _held_bytes(held, list(block.parameters())) == x.nbytes
        if call == 4:
            (done, held), = full_calls
            assert done.fell_back and held == [] and block_reruns["reruns"] == 1
        if call == 5:
            assert not full_calls and block_reruns["reruns"] == 1 and sum(forward_dispatches.values()) == 0


class _Nonzero(nn.Module):
    """Rows picked by a data-dependent mask (`nonzero`): the recorded sizes do not hold for other data."""

    def __init__(self, dim=16):
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        h = torch.nn.functional.silu(self.a(x))
        rows = (h.sum(-1) > 0).nonzero().squeeze(-1)
        return self.b(h.index_select(0, rows)).sum(0, keepdim=True) * h


def test_full_keeps_torchs_checkpoint_for_data_dependent_ops_and_under_compile(block_reruns, full_calls):
    """A block with `nonzero` gets no direct recompute (its rows come from data), even when
    the recorded calls agree; under compile the wrapper is torch's plain checkpoint."""
    from parallelisms.ac_direct import data_dependent_step
    torch.manual_seed(0)
    block = _Nonzero()
    policy = FullAC(ActivationCheckpointConfig(mode="full"))
    kwargs = policy.checkpoint_kwargs(block, prefix="m")
    same, other = torch.randn(6, 16), torch.randn(6, 16)
    for x in (same, same, same, other):
        block_reruns.clear()
        _assert_equal(_grads(block, (x,)), _grads(block, (x,), kwargs))
        assert block_reruns["reruns"] == 1 and not full_calls
    plan = next(iter(policy.plans.values()))
    assert plan.direct is None and plan.full_direct is None  # (refused for every mode: ac_direct.build_direct)
    assert data_dependent_step(plan.source) == "aten.nonzero.default"
    compiled = FullAC(ActivationCheckpointConfig(mode="full"))
    compiled.compile_enabled = True
    assert "context_fn" not in compiled.checkpoint_kwargs(block, prefix="m") and compiled.calibrated(block, "m")


def test_deepseek_dense_block_stays_direct_and_moe_block_keeps_torchs_checkpoint(full_calls, block_reruns):
    """DeepSeek's dense block takes the direct path and keeps it: its `matmul` of a 3-d input
    reshapes through `view` under the recording calls' dispatch mode and `_reshape_alias`
    without one, the same op (before, every call 3 fell back). Its MoE block reads a buffer
    autograd does not pack, so it keeps torch's checkpoint. Bitwise against `none`."""
    from tests.test_ac_multirank import _build
    base, spec = _build("deepseek_v3")
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
               for _ in range(4)]
    runs, seen = {}, []
    for mode in ("none", "full"):
        model = copy.deepcopy(base)
        policy = apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=mode), spec=spec)
        runs[mode] = []
        for tokens, target in batches:
            model.zero_grad(set_to_none=True)
            full_calls.clear()
            block_reruns.clear()
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
            loss.backward()
            seen.append(([call.fell_back for call, _ in full_calls], block_reruns["reruns"]))
            runs[mode].append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    for (loss_ref, grads_ref), (loss, grads) in zip(runs["none"], runs["full"]):
        assert torch.equal(loss_ref, loss) and all(torch.equal(a, b) for a, b in zip(grads_ref, grads))
    assert seen[6:] == [([False], 1), ([False], 1)]  # calls 3 and 4: the dense block direct, the MoE block re-run
    dense, moe = policy.plans.values()
    assert dense.full_direct is not None and moe.full_direct is None


def test_full_logs_its_path_once_per_block(monkeypatch, caplog):
    """With AC_TRACE=1 each block logs once which path `full` took, and why not the direct one
    (the gated block holds x and the three weights of its 9 packs)."""
    import logging

    from parallelisms.ac_trace import reset_ac_trace
    monkeypatch.setenv("AC_TRACE", "1")
    reset_ac_trace()
    torch.manual_seed(0)
    policy = FullAC(ActivationCheckpointConfig(mode="full"))
    with caplog.at_level(logging.INFO, logger="ac"):
        for block, prefix in ((_Gated(), "gated"), (_Nonzero(), "picked")):
            kwargs = policy.checkpoint_kwargs(block, prefix=prefix)
            x = torch.randn(6, 16)
            for _ in range(4):
                _assert_equal(_grads(block, (x,)), _grads(block, (x,), kwargs))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AC_TRACE FULL")]
    assert lines == ["AC_TRACE FULL gated: recomputes 4 ops directly, holds 4 of 9 packs",
                     "AC_TRACE FULL picked: torch's checkpoint: aten.nonzero.default's output depends on data"]
    reset_ac_trace()
