"""The eager memory-budget SAC (`activation_checkpoint.mode = "budget"`): the knapsack, the
measurement of a block, saved bytes within the budget, recompute FLOPs within 5% of the
brute-force optimum, bitwise numerics against `none`, AC_TRACE and config validation.

Single process, fp32 on CPU. Blocks: one Llama debug_small block (8 candidate ops) and one
tiny DeepSeek MoE block (MLA, routed and shared experts; under 20 candidates).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import math

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from parallelisms.ac_budget import BudgetSAC, solve_knapsack
from parallelisms.ac_measure import SavedActivationCounter, flop_counter, saved_activation_bytes
from parallelisms.ac_trace import reset_ac_trace
from parallelisms.activation_checkpoint import ActivationCheckpointConfig, apply_activation_checkpointing, policy_for
from tests.ac_helpers import assert_bitwise, seeded_llama, tiny_deepseek, train_steps
from trainer.config import load_config
from configuration.fields import ConfigError


def test_knapsack_is_exact_on_a_known_instance_and_never_over_capacity():
    items = [(5, 10), (4, 40), (6, 30), (3, 50)]
    assert solve_knapsack(items, 10) == [1, 3]  # 4 + 3 <= 10, value 90 (brute force: best)
    assert solve_knapsack(items, 0) == []
    assert solve_knapsack([(3, 0), (2, 5)], 5) == [1]  # value-0 items are never taken


def _all_subsets(items):
    """[2^n] total weights and values of every subset (brute force, vectorised)."""
    n = len(items)
    member = (np.arange(1 << n)[:, None] >> np.arange(n)) & 1  # [2^n, n]
    w, v = (np.array([it[k] for it in items], dtype=np.int64) for k in (0, 1))
    return member, member @ w, member @ v


@pytest.mark.parametrize("seed", range(4))
def test_knapsack_guarantees_over_many_random_instances(seed):
    """What solve_knapsack promises, checked by brute force on 250 instances per seed:
    never over capacity; on a grid of unit u (the weights' gcd, or capacity/buckets if that
    grid would be finer) it is the exact optimum with weights rounded up to whole units; so
    it is worth at least every subset S that fits with |S| units of slack
    (weight(S) + |S| u <= capacity), and with the default grid it is the true optimum."""
    rng = np.random.default_rng(seed)
    for _ in range(250):
        n = int(rng.integers(1, 11))
        items = [(int(rng.integers(1, 10_000)) * 7, int(rng.integers(0, 1000))) for _ in range(n)]
        cap = int(rng.integers(0, 40_000))
        member, weight, value = _all_subsets(items)
        for buckets in (64, 256, 1 << 15):
            got = solve_knapsack(items, cap, buckets=buckets)
            got_w, got_v = sum(items[i][0] for i in got), sum(items[i][1] for i in got)
            assert got_w <= cap and all(items[i][1] > 0 for i in got)
            unit = max(math.gcd(*[w for w, v in items if v > 0] or [1]), -(-cap // buckets), 1)
            rounded = member @ np.array([-(-w // unit) for w, _ in items])
            assert got_v == value[rounded <= cap // unit].max()  # exact on the grid
            assert got_v >= value[weight + member.sum(1) * unit <= cap].max()  # within |S| units of slack
            if unit == math.gcd(*[w for w, v in items if v > 0] or [1]):
                assert got_v == value[weight <= cap].max()  # no rounding: the true optimum


def _block(which: str):
    model = seeded_llama("debug_small") if which == "llama" else tiny_deepseek()
    block = model.layers["1"]
    torch.manual_seed(5)
    x = torch.randn(2, 16, model.args.dim, requires_grad=True)
    return block, x, model.rope_cache[:16]


def _spec(which: str):
    from models import MODEL_SPECS
    return MODEL_SPECS["llama3" if which == "llama" else "deepseek_v3"]


def _backward_flops(block, x, rope, ckpt):
    with flop_counter() as fwd:
        out = block(x, rope) if ckpt is None else checkpoint(block, x, rope, use_reentrant=False, **ckpt)
    with flop_counter() as bwd:
        out.backward(torch.ones_like(out))
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.mark.parametrize("which", ["llama", "deepseek"])
def test_budget_fits_and_is_within_5_percent_of_brute_force(which):
    block, x, rope = _block(which)
    spec = _spec(which)
    none_bytes = saved_activation_bytes(block, x, rope, mode="none")
    _, none_bwd = _backward_flops(block, x, rope, None)
    checked = 0
    for fraction in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0):
        cfg = ActivationCheckpointConfig(mode="budget", budget_fraction=fraction)
        policy = policy_for(cfg, spec=spec)
        assert isinstance(policy, BudgetSAC)
        ckpt = {**policy.checkpoint_kwargs(block, prefix="layers.1"), "preserve_rng_state": False}
        checkpoint(block, x, rope, use_reentrant=False, **ckpt)  # the measuring call (runs as full)
        (calib,) = policy.calibrations.values()
        (choice,) = policy.choices.values()
        assert calib.none_bytes == none_bytes  # the calibration sees what `none` keeps, exactly
        cands = calib.candidates
        assert 0 < len(cands) <= 20
        budget = int(fraction * none_bytes)
        assert choice.budget == budget
        exclude = list(block.parameters()) + list(block.buffers()) + [rope]
        # Call 2 records the recompute plan, call 3 applies it (with the dispatch modes), call 4
        # runs the fast paths when the kept outputs are all packed (ac_replay, ac_direct): calls 3
        # and 4 keep and recompute the same. (The flop counter's module hooks add view ops: it must
        # see every pass, or the op counts differ from the recorded call's and the plan is dropped.)
        with flop_counter():
            out = checkpoint(block, x, rope, use_reentrant=False, **ckpt)
            out.backward(torch.ones_like(out))
        for _ in range(2):
            with SavedActivationCounter(exclude) as counter, flop_counter():
                out = checkpoint(block, x, rope, use_reentrant=False, **ckpt)
            with flop_counter() as bwd:
                out.backward(torch.ones_like(out))
            recompute = bwd.get_total_flops() - none_bwd
            assert counter.total_bytes == choice.kept_bytes
            assert recompute == choice.recompute_flops
        x.grad = None
        floor = calib.input_bytes + calib.pinned_bytes
        if budget < floor:  # nothing can be kept beyond what every choice keeps
            assert choice.keep == frozenset()
            continue
        assert counter.total_bytes <= budget
        room = budget - floor
        # Run whatever is kept (as the knapsack counts): ops with FLOPs in the chains of several
        # packs (MLA's wkv_b, whose output is split into k and v).
        forced = sum(c.value for c in calib.forced)
        assert (forced > 0) == (which == "deepseek")
        optimum = forced + min(sum(c.value for c in cands) - sum(cands[i].value for i in s)
                      for r in range(len(cands) + 1) for s in itertools.combinations(range(len(cands)), r)
                      if sum(cands[i].nbytes for i in s) <= room)
        print(f"{which} fraction {fraction}: kept {counter.total_bytes} of budget {budget} (none {none_bytes}); "
              f"recompute {recompute} FLOPs, optimum {optimum}")
        assert recompute <= 1.05 * optimum
        checked += 1
    assert checked >= 5


def test_budget_full_range_on_llama_block():
    """budget 0 keeps what full keeps; budget infinity keeps what none keeps (every pack) and,
    once its plan applies, recomputes no FLOPs."""
    block, x, rope = _block("llama")
    full = saved_activation_bytes(block, x, rope, mode="full")
    none_bytes = saved_activation_bytes(block, x, rope, mode="none")
    zero = saved_activation_bytes(block, x, rope, mode="budget", cfg=ActivationCheckpointConfig(budget_mib=0.0))
    assert zero == full
    policy = policy_for(ActivationCheckpointConfig(mode="budget", budget_mib=1e9))
    ckpt = {**policy.checkpoint_kwargs(block, prefix="layers.1"), "preserve_rng_state": False}
    checkpoint(block, x, rope, use_reentrant=False, **ckpt)
    (choice,) = policy.choices.values()
    assert choice.recompute_flops == 0 and full < choice.kept_bytes == none_bytes
    _, none_bwd = _backward_flops(block, x, rope, None)
    for _ in range(3):  # records its plan, applies it, runs the fast paths
        _, bwd = _backward_flops(block, x, rope, ckpt)
    assert bwd == none_bwd


@pytest.mark.parametrize("which", ["llama", "deepseek"])
def test_budget_mode_is_bitwise_equal_to_none(which):
    base = seeded_llama("debug_small") if which == "llama" else tiny_deepseek()
    g = torch.Generator().manual_seed(3)
    vocab = base.args.vocab_size
    batches = [(torch.randint(0, vocab, (2, 16), generator=g), torch.randint(0, vocab, (2, 16), generator=g))
               for _ in range(4)]
    spec = _spec(which)

    def run(mode, **cfg):  # 4 steps: from the 4th, blocks whose kept outputs are all packed run the fast paths
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=mode, **cfg), spec=spec)
        torch.manual_seed(1234)
        return train_steps(model, batches, steps=4)

    ref = run("none")
    for cfg in ({"budget_fraction": 0.3}, {"budget_mib": 0.05}):
        assert_bitwise(ref, run("budget", **cfg))


def test_budget_trace_prints_the_chosen_set(monkeypatch, caplog):
    monkeypatch.setenv("AC_TRACE", "1")
    reset_ac_trace()
    model = seeded_llama("debug_small")
    policy = policy_for(ActivationCheckpointConfig(mode="budget", budget_fraction=0.3))
    policy.apply(model)
    with caplog.at_level(logging.INFO, logger="ac"):
        for _ in range(2):
            model(torch.randint(0, 2048, (2, 16))).sum().backward()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AC_TRACE BUDGET")]
    assert len(lines) == 1, lines  # one kind of block: measured and chosen once
    (choice,) = policy.choices.values()
    assert lines[0].startswith("AC_TRACE BUDGET layers.0: keeps ")
    for op, index in choice.keep:
        assert f"{op}#{index}" in lines[0]


def test_budget_config():
    cfg = load_config(["--activation_checkpoint.mode", "budget", "--activation_checkpoint.budget_mib", "64"])
    assert (cfg.activation_checkpoint.mode, cfg.activation_checkpoint.budget_mib) == ("budget", 64.0)
    assert cfg.activation_checkpoint.budget_fraction == 0.5
    for args, needle in ((["--activation_checkpoint.budget_fraction", "1.5"], "above the maximum 1.0"),
                         (["--activation_checkpoint.budget_mib", "-1"], "below the minimum 0.0"),
                         (["--activation_checkpoint.mode", "budget", "--compile.enable", "true"],
                          "under compile.enable use mode memory_budget")):
        with pytest.raises(ConfigError) as e:
            load_config(args)
        assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="memory_budget"):
        policy_for(dataclasses.replace(ActivationCheckpointConfig(), mode="budget"), compile_enabled=True)
    assert copy.deepcopy(cfg.activation_checkpoint).budget_mib == 64.0


def _four_steps_of_none(seed: int):
    """(a fresh copy of the debug_small Llama, 4 batches, the un-checkpointed run's 4 steps on them)."""
    base = seeded_llama("debug_small")
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randint(0, 2048, (2, 16), generator=g), torch.randint(0, 2048, (2, 16), generator=g))
               for _ in range(4)]
    torch.manual_seed(1234)
    return copy.deepcopy(base), batches, train_steps(copy.deepcopy(base), batches, steps=4)


def test_budget_keeps_packed_outputs_and_runs_its_fast_paths_bitwise(monkeypatch):
    """The knapsack chooses among the outputs autograd packs: q after RoPE, not wq's output
    before it (which would spare the same matmul for the same bytes and bar the fast paths).
    So from a block's fourth call its forward runs with no dispatch mode (ac_replay) and its
    recompute directly (ac_direct), bitwise equal to `none`. (Blocks of one kind share the
    measurement: block 0 measures in step 1, records in 2, applies in 3; the others record
    in step 1.) Before, every budget block stayed on the dispatch-mode path."""
    import parallelisms.activation_checkpoint as ac
    model, batches, ref = _four_steps_of_none(seed=4)
    policy = ac.apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="budget", budget_fraction=0.5))
    events = []
    make_modes = ac.make_sac_modes
    monkeypatch.setattr(ac, "make_sac_modes", lambda p: (events.append("modes"), make_modes(p))[1])
    model.register_forward_pre_hook(lambda *_: events.append("step"))
    torch.manual_seed(1234)
    assert_bitwise(ref, train_steps(model, batches, steps=4))
    per_step = [chunk.count("modes") for chunk in " ".join(events).split("step")[1:]]
    n = len(model.layers)
    assert per_step == [n, n, 1, 0], per_step
    (choice,) = policy.choices.values()
    assert ("aten.add.Tensor", 0) in choice.keep and ("aten.mm.default", 0) not in choice.keep, choice.keep
    assert all(plan.replay is not None and plan.direct is not None for plan in policy.plans.values())


def test_budget_zero_recomputes_directly_through_rmsnorms_inplace_add():
    """Budget 0 keeps only the block's input, so the direct recompute rebuilds RMSNorm's
    `rsqrt` column: `mean`, then its in-place `add_` of eps, run as steps on the fresh
    tensor. (In-place steps were refused: such blocks fell back to the dispatch-mode
    recompute.) Bitwise equal to `none` over 4 steps, the 4th on the fast paths."""
    model, batches, ref = _four_steps_of_none(seed=6)
    policy = apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="budget", budget_mib=0.0))
    torch.manual_seed(1234)
    assert_bitwise(ref, train_steps(model, batches, steps=4))
    (choice,) = policy.choices.values()
    assert choice.keep == frozenset()
    for plan in policy.plans.values():
        steps = [str(op) for op, *_ in plan.direct.steps]
        assert steps.count("aten.add_.Scalar") == 2
        assert steps.index("aten.add_.Scalar") == steps.index("aten.mean.dim") + 1  # (the first RMSNorm's)
