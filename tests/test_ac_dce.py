"""The op-level SAC recompute plan (parallelisms/ac_dce.py): what the recompute skips, and when it must not.

Each test runs a block twice (the first call records the plan, the second applies it) and
checks the gradients against the un-checkpointed block bitwise, plus what the plan is for:
the ops the recompute runs, the saved set, and the cases where nothing may be skipped
(random ops, in-place updates of a buffer, a call whose ops differ from the recorded one).
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import _RECOMPUTE, _CachedTorchDispatchMode, checkpoint

from parallelisms import ac_modes
from parallelisms.activation_checkpoint import ActivationCheckpointConfig, OpSAC

aten = torch.ops.aten


@pytest.fixture
def recomputed(monkeypatch):
    """Counts the ops the recompute really runs (their cache entry says recompute)."""
    ran: collections.Counter = collections.Counter()
    cls = ac_modes._MODE_CLASSES[_CachedTorchDispatchMode]
    real = cls.__torch_dispatch__

    def dispatch(self, func, types, args=(), kwargs=None):
        slot = self.slots.get(id(func))  # [op, kind, entries, next index, callable]
        entry = self.storage.get(func, {}).get(slot[3] if slot is not None else 0)
        if entry is _RECOMPUTE or self.run_all:
            ran[func] += 1
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(cls, "__torch_dispatch__", dispatch)
    return ran


def _grads(block, inputs, kwargs=None):
    """(output, input grad, param grads) of one forward + backward, with `kwargs` for checkpoint (None: plain)."""
    x = inputs[0].detach().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    out = block(x, *inputs[1:]) if kwargs is None else checkpoint(block, x, *inputs[1:], use_reentrant=False, **kwargs)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


def _assert_equal(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][n], b[2][n]) for n in a[2])


def test_llama_block_recompute_skips_rope_and_the_projections_feeding_it(recomputed):
    from tests.ac_helpers import block_inputs, seeded_llama
    model = seeded_llama("debug_small")
    block = model.layers["0"]
    inputs = block_inputs(model)
    policy = OpSAC(ActivationCheckpointConfig(mode="op"))
    kwargs = policy.checkpoint_kwargs(block, prefix="layers.0")
    ref = _grads(block, inputs)
    _assert_equal(ref, _grads(block, inputs, kwargs))  # records the plan
    first = collections.Counter(recomputed)
    recomputed.clear()
    _assert_equal(ref, _grads(block, inputs, kwargs))  # applies it
    plan = policy.plans[next(iter(policy.plans))]
    assert {str(op) for op, _ in plan.promoted} == {"aten.add.Tensor", "aten.rsqrt.default"}  # q, k after RoPE
    # Without the plan: wk, wo, w3 and both RoPE rotations (cat) and RMSNorms (pow) run again.
    assert first[aten.mm.default] == 3 and first[aten.cat.default] == 2 and first[aten.pow.Tensor_Scalar] == 2
    # With it: only wo and w3 (their outputs feed what backward reads), no RoPE, no norm statistics.
    assert recomputed[aten.mm.default] == 2
    for op in (aten.cat.default, aten.neg.default, aten.pow.Tensor_Scalar, aten.mean.dim, aten.rsqrt.default):
        assert recomputed[op] == 0, op


class _SideEffects(nn.Module):
    """Dropout (random), an in-place count into a buffer, a branch on a flag, and a dead chain."""

    def __init__(self, dim=16):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.register_buffer("calls", torch.zeros(()))
        self.branch = False

    def forward(self, x):
        self.calls.add_(1)  # runs again in the recompute (as without a plan): not skipped
        h = torch.nn.functional.dropout(self.a(x).relu(), 0.5, training=True)
        if self.branch:  # another op sequence than the recorded call
            h = h * 2 + 1
        return self.c(self.b(h).exp() * h)


@pytest.fixture
def forward_dispatches(monkeypatch):
    """Counts the ops the forward's caching mode intercepts."""
    from torch.utils.checkpoint import _CachingTorchDispatchMode
    seen: collections.Counter = collections.Counter()
    cls = ac_modes._MODE_CLASSES[_CachingTorchDispatchMode]
    real = cls.__torch_dispatch__

    def dispatch(self, func, types, args=(), kwargs=None):
        seen[func] += 1
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(cls, "__torch_dispatch__", dispatch)
    return seen


class _Gated(nn.Module):
    """silu(a x) gates b's output; every output op SAC keeps is also packed by autograd (a's
    by silu), so the block's plan gets a replay. `branch` inserts ops before b."""

    def __init__(self, dim=16):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.branch = False

    def forward(self, x):
        h = torch.nn.functional.silu(self.a(x))
        if self.branch:
            h = h * 2 + 1
        return self.c(self.b(h) * h)


def gated_calls(policy, branches, *counters):
    """Runs a seeded `_Gated` block once per entry of `branches` (its `branch` for that call)
    under `policy`, each call bitwise equal to the plain block; yields (call number from 1,
    the block's plan, the block, its input) after each, with `counters` cleared before the
    checkpointed call."""
    torch.manual_seed(0)
    block = _Gated()
    x = torch.randn(4, 16)
    kwargs = policy.checkpoint_kwargs(block, prefix="m")
    for call, branch in enumerate(branches, start=1):
        block.branch = branch
        ref = _grads(block, (x,))
        for counter in counters:
            counter.clear()
        _assert_equal(ref, _grads(block, (x,), kwargs))
        yield call, next(iter(policy.plans.values()), None), block, x


def test_replayed_forward_runs_without_a_dispatch_mode_and_falls_back_on_other_packs(recomputed,
                                                                                       forward_dispatches,
                                                                                       monkeypatch):
    """Call 1 records the plan, call 2 applies it (and builds the replay), call 3 runs its
    forward with no dispatch mode. Call 4 takes another branch: its packs differ from the
    replay's, so its recompute runs every op (as full AC) and the block goes back to the
    dispatch-mode path. Every call is bitwise equal to the plain block. (The replay's own
    recompute, through the dispatch mode: the direct recompute is off here.)"""
    monkeypatch.setattr(OpSAC, "direct_recompute", False)
    policy = OpSAC(ActivationCheckpointConfig(mode="op"))
    for call, plan, *_ in gated_calls(policy, (False, False, False, True, True, False), recomputed,
                                      forward_dispatches):
        if call == 2:
            assert plan.replay is not None and len(plan.replay.kept) == 1  # a's output, cut from silu's pack
        if call == 3:
            assert sum(forward_dispatches.values()) == 0
            assert recomputed[aten.mm.default] == 1 and recomputed[aten.silu.default] == 1  # b; a's output was kept
        if call == 4:
            assert sum(forward_dispatches.values()) == 0 and recomputed[aten.mm.default] == 2  # a and b: every op ran
            assert plan.replay is None
        if call == 5:
            assert sum(forward_dispatches.values()) > 0


def test_direct_recompute_runs_only_what_backward_reads_and_falls_back_on_other_packs(recomputed,
                                                                                        forward_dispatches):
    """From call 3 neither pass has a dispatch mode, nor torch's checkpoint bookkeeping: the
    block's own saved-tensor hooks take the packs, drop those the forward does not keep, and
    the first unpack that needs one runs b's matmul, SiLU and the gate product (what backward
    reads that the forward did not keep) directly. Call 4 takes another branch: its packs
    differ, so it drops nothing (it keeps what `none` keeps, and recomputes nothing), and the
    next call is back on the dispatch-mode path. Bitwise every call."""
    from parallelisms.ac_direct import _DirectCall
    policy = OpSAC(ActivationCheckpointConfig(mode="op"))
    calls = collections.Counter()
    real_exit, real_rebuild = _DirectCall.__exit__, _DirectCall._rebuild

    def exit_(self, *exc):
        out = real_exit(self, *exc)
        if self.lost:
            calls["dropped"] += len(self.lost)
        return out

    def rebuild(self):
        calls["rebuilt"] += 1
        return real_rebuild(self)

    _DirectCall.__exit__, _DirectCall._rebuild = exit_, rebuild
    try:
        for call, plan, *_ in gated_calls(policy, (False, False, False, True, False), recomputed,
                                          forward_dispatches, calls):
            if call == 2:
                assert [str(op) for op, *_ in plan.direct.steps] == ["aten.silu.default", "aten.mm.default",
                                                                       "aten.mul.Tensor"]
            if call == 3:
                assert sum(forward_dispatches.values()) == 0 and sum(recomputed.values()) == 0
                assert calls == {"rebuilt": 1, "dropped": sum(not k for k in plan.direct.keep)} and calls["dropped"] > 0
            if call == 4:
                assert calls == {} and plan.direct is None and plan.replay is None
                assert sum(forward_dispatches.values()) == 0 and sum(recomputed.values()) == 0
            if call == 5:
                assert sum(forward_dispatches.values()) > 0 and not calls
    finally:
        _DirectCall.__exit__, _DirectCall._rebuild = real_exit, real_rebuild


class _Mutating(_Gated):
    """`_Gated` that, with `mutate`, scales a's output in place after SiLU packed it."""

    mutate = False

    def forward(self, x):
        a = self.a(x)
        h = torch.nn.functional.silu(a)
        if self.mutate:
            a.mul_(2)
        return self.c(self.b(h) * h)


def test_direct_call_keeps_autograds_inplace_check():
    """The direct call's own hooks hold the packs, so autograd's version check is theirs to
    keep: a pack modified in place after it was saved fails backward as it does without
    checkpointing, instead of feeding the modified values to the gradient."""
    torch.manual_seed(0)
    block = _Mutating()
    x = torch.randn(4, 16)
    policy = OpSAC(ActivationCheckpointConfig(mode="op"))
    kwargs = policy.checkpoint_kwargs(block, prefix="m")
    for _ in range(3):
        _assert_equal(_grads(block, (x,)), _grads(block, (x,), kwargs))
    assert next(iter(policy.plans.values())).direct is not None
    block.mutate = True
    for run in (None, kwargs):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _grads(block, (x,), run)


@pytest.mark.parametrize("direct", [True, False])
def test_llama_forward_is_replayed_from_the_third_step_bitwise(forward_dispatches, monkeypatch, direct):
    """Step 1 records each block's plan, step 2 applies it through the dispatch modes, step
    3 replays it: no op reaches the caching mode, and the gradients equal `none`'s. With
    `direct`, step 3's recompute runs RMSNorm's two multiplies (twice), `wo`, the residual
    add, SiLU, `w3` and the SwiGLU product, and nothing else."""
    monkeypatch.setattr(OpSAC, "direct_recompute", direct)
    from tests.ac_helpers import seeded_llama, token_batches, train_against_none
    dispatched = []
    policy, _ = train_against_none(seeded_llama("debug_small"), "op", token_batches(3), before=forward_dispatches.clear,
                                   after_forward=lambda: dispatched.append(sum(forward_dispatches.values())))
    assert dispatched[3] > 0 and dispatched[4] > 0 and dispatched[5] == 0  # op's steps 1, 2, 3
    assert all(p.replay is not None for p in policy.plans.values()) and len(policy.plans) == 3
    steps = [[str(op) for op, *_ in p.direct.steps] if p.direct is not None else None for p in policy.plans.values()]
    mul, mm = "aten.mul.Tensor", "aten.mm.default"
    assert steps == ([[mul, mul, mm, "aten.add.Tensor", mul, mul, "aten.silu.default", mm, mul]] * 3 if direct
                     else [None] * 3)


def test_random_ops_buffer_updates_and_another_op_sequence_are_never_skipped(recomputed):
    torch.manual_seed(0)
    block = _SideEffects()
    x = torch.randn(4, 16)
    policy = OpSAC(ActivationCheckpointConfig(mode="op"))
    kwargs = policy.checkpoint_kwargs(block, prefix="m")
    for branch in (False, False, True, True):
        block.branch = branch
        torch.manual_seed(1)
        ref = _grads(block, (x,))
        torch.manual_seed(1)
        calls = block.calls.item()
        recomputed.clear()
        _assert_equal(ref, _grads(block, (x,), kwargs))
        assert block.calls.item() == calls + 2  # the forward and the recompute
        assert recomputed[aten.add_.Tensor] == 1 and recomputed[aten.bernoulli_.float] == 1  # dropout's mask
    assert len(policy.plans) == 1  # the branch made the plan stale; it was recorded again


class _HostRead(nn.Module):
    """Split sizes read to the host with `.tolist()` (as EP's dispatcher does): on a CPU tensor
    that reads its memory without dispatching an op, so no recorded op reads the `cat`."""

    def __init__(self, dim=16):
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        h = self.a(x)
        sizes = torch.cat([(h[:, 0] * 0 + 1).sum().reshape(1), (h[:, 0] * 0 + 3).sum().reshape(1)])
        first, rest = h.split([int(n) // 4 for n in sizes.long().tolist()])
        return torch.cat([self.b(first.relu()), rest.exp()])


def test_an_output_read_without_an_op_is_recomputed_not_a_placeholder(recomputed):
    """The split sizes are read only by `.tolist()`: the recompute must give it their values (a
    Placeholder there is uninitialised memory: garbage split sizes, an intermittent overflow in
    EP's recompute; without the fix this test fails with sizes like 23583123659336)."""
    torch.manual_seed(0)
    block = _HostRead()
    x = torch.randn(16, 16)
    policy = OpSAC(ActivationCheckpointConfig(mode="op"))
    kwargs = policy.checkpoint_kwargs(block, prefix="m")
    for call in (1, 2):
        ref = _grads(block, (x,))
        recomputed.clear()
        _assert_equal(ref, _grads(block, (x,), kwargs))
    plan = next(iter(policy.plans.values()))
    # `.long()`'s output is what `.tolist()` reads: kept (it is tiny), not released to a Placeholder.
    assert (aten._to_copy.default, 0) in plan.promoted and (aten._to_copy.default, 0) not in plan.placeholders


def test_budget_applies_its_plan_from_the_third_call_bitwise():
    """`budget` measures on a block's first call and records its plan on the second; the
    third step is the first to skip, and stays bitwise equal to `none`."""
    import copy

    from parallelisms.activation_checkpoint import apply_activation_checkpointing
    from tests.ac_helpers import assert_bitwise, seeded_llama, run_mode, train_steps
    base = seeded_llama("debug_small")
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 2048, (2, 16), generator=g), torch.randint(0, 2048, (2, 16), generator=g))
               for _ in range(3)]
    ref = run_mode(base, "none", batches)
    model = copy.deepcopy(base)
    policy = apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="budget", budget_fraction=0.3))
    torch.manual_seed(1234)
    assert_bitwise(ref, train_steps(model, batches))
    assert len(policy.plans) == len(model.layers)  # each block's plan, applied in step 3


def _train_autocast(model, batches):
    """Loss and grads per step, forward and backward inside one bf16 autocast region (as the
    trainer runs one GPU without FSDP): the recompute then finds autocast's weight casts cached."""
    from tests.ac_helpers import clean_name
    record = []
    for inputs, target in batches:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, -2).float(), target.flatten())
            loss.backward()
        record.append((loss.detach(), {clean_name(n): p.grad.clone() for n, p in model.named_parameters()}))
    return record


@pytest.mark.parametrize("count_param_casts", [False, True])
def test_plan_under_autocast_with_backward_in_the_region(monkeypatch, caplog, count_param_casts):
    """gpu_check's `llama_eager_op` row failed with "aten.mul.Scalar encountered during
    backward but not found in storage": autocast casts each weight once per region, so the
    recompute (inside the same region) dispatched fewer `_to_copy`s than the forward, and the
    plan's kept RoPE cast (by invocation index) was handed to another cast. Parameter casts
    now bypass the cache (the plan is applied, bitwise); were they counted again, the
    recording call's recompute sees the other op sequence and the block gets no plan."""
    import copy

    from parallelisms.activation_checkpoint import apply_activation_checkpointing
    from tests.ac_helpers import assert_bitwise, seeded_llama
    if count_param_casts:
        monkeypatch.setattr(ac_modes, "is_param_cast", lambda args: False)
    base = seeded_llama("debug_small")
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 2048, (2, 16), generator=g), torch.randint(0, 2048, (2, 16), generator=g))
               for _ in range(3)]
    ref = _train_autocast(copy.deepcopy(base), batches)
    model = copy.deepcopy(base)
    policy = apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="op"))
    with caplog.at_level("WARNING", logger="ac"):
        got = _train_autocast(model, batches)
    assert_bitwise(ref, got)
    plans = list(policy.plans.values())
    assert len(plans) == len(model.layers)
    if count_param_casts:
        assert all("_to_copy" in p.disabled for p in plans) and "no recompute plan" in caplog.text
    else:
        assert not any(p.disabled for p in plans) and all(p.promoted for p in plans)
        assert "no recompute plan" not in caplog.text


@pytest.mark.parametrize("method", ["allgather", "alltoall"])
def test_plan_keeps_no_more_than_op_without_it_under_context_parallel(monkeypatch, method):
    """Under CP the attention inputs are copies of a kept collective output (the reorder of
    the gathered K/V; Ulysses' regroup of the received q, k, v). Keeping them too held the
    gathered K/V twice (llama8b_128k op at cp 8: 71.8 -> 88.0 GiB on the GPU). Estimated on
    fake tensors (2 fake ranks, the trainer's own assembly): op's bytes per block with the
    plan are at most those without it."""
    from trainer.config import load_config
    from trainer.memory import estimate_memory

    def per_block(plan: bool) -> int:
        monkeypatch.setattr(OpSAC, "recompute_plan", plan)
        cfg = load_config(["--config", "llama_debug.toml", "--activation_checkpoint.mode", "op", "--training.seq_len",
                           "256", "--parallelism.context_parallel_degree", "2",
                           "--parallelism.context_parallel_method", method])
        (saved,) = estimate_memory(cfg, 2).activations_per_block.values()
        return saved

    without, with_plan = per_block(False), per_block(True)
    assert 0 < with_plan <= without, (with_plan, without)


def test_plan_on_tensor_parallel_blocks_is_bitwise(recomputed):
    """TP (a 1-rank mesh: the same DTensor ops, collectives and `from_local` wrappers as
    TP 2) with sequence parallel. The feed-forward's `silu(w1 x) * w3 x` is a plain tensor
    that only a DTensor op reads (w2's rowwise matmul, through `from_local`, which
    dispatches no op). Keyed by the DTensor wrapper's own stand-in storage, that read was
    missed: the product got a Placeholder and w2's gradient was garbage from the second
    step on (test_parallel_layouts' tp2_ac_op). Storages are now those inside a subclass.
    `budget` too, over 4 steps (it measures, records, then applies its plan)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from models.llama3.parallelize import parallelize_llama
    from parallelisms.activation_checkpoint import apply_activation_checkpointing
    from tests.ac_helpers import clean_name, seeded_llama
    from trainer.config import load_config

    g = torch.Generator().manual_seed(4)
    batches = [(torch.randint(0, 2048, (2, 16), generator=g), torch.randint(0, 2048, (2, 16), generator=g))
               for _ in range(4)]
    base = seeded_llama("debug_small")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        parallelism = load_config(["--parallelism.disable_loss_parallel", "true"]).parallelism
        runs, policies = {}, {}
        for mode in ("none", "budget", "op"):  # (op last: `recomputed` is its last step's)
            model = copy.deepcopy(base)
            parallelize_llama(model, mesh, parallelism)
            policies[mode] = apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=mode))
            runs[mode] = []
            for inputs, target in batches:  # the first call of each block records its plan, the second applies it
                model.zero_grad(set_to_none=True)
                recomputed.clear()
                logits = model(inputs)  # [batch, seq, vocab], gathered (no loss parallel)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2), target.flatten())
                loss.backward()
                runs[mode].append((loss.detach(), {clean_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}))
    finally:
        dist.destroy_process_group()
    for mode in ("op", "budget"):
        for (loss_ref, grads_ref), (loss, grads) in zip(runs["none"], runs[mode]):
            assert torch.equal(loss_ref, loss), mode
            assert all(torch.equal(grads_ref[n], grads[n]) for n in grads_ref), \
                (mode, [n for n in grads_ref if not torch.equal(grads_ref[n], grads[n])])
    assert len(policies["budget"].plans) == 3
    plans = list(policies["op"].plans.values())
    assert len(plans) == 3 and not any(p.disabled for p in plans)
    assert all(len(p.placeholders) >= 8 for p in plans)  # the plan skips ops (here: RoPE and what feeds it)
    assert recomputed[aten.cat.default] == 0  # no RoPE rotation ran in the last step's recompute
