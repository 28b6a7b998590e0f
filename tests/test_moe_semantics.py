"""The MoE semantics table of docs/moe.md ("Semantics: routing, balancing and the aux
losses"), one test per row, and the review's MoE fixes.

- When the bias updates, from which forwards, reduced over which meshes: one 2-rank launch
  (tests/moe_semantics_worker.py) records the loads behind every bias update under FSDP 2,
  CP 2, TP 2 with and without SP, PP 2 and EP 2, against one rank (and accumulation and
  full AC in process); validation forwards and skipped steps do not count.
- The sequence aux loss under every layout: CP here (issue 19: each CP rank computed it
  from its own S / cp tokens, and FSDP summed the router gradients over dp_shard x cp, so
  its gradient came out ~cp times too large; now the counts are summed over CP, and TP
  under SP, by a plan-installed reduction, parallelisms/sequence_shards.py). DeepSeek debug
  with `--moe.aux_loss_coeff 0.01` at cp 2 (both methods) and cp 2 x tp 2 equals one rank
  within 1e-5 (before the fix the router's gradients were 1.23 relative off). dp, tp with
  SP, pp, accumulation and ep: tests/test_moe_balance.py.
- The batch-scope aux loss (Qwen3), top-k normalisation per model, dropless routing, and
  the [moe] fields that change them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_in_process, torchrun

TOL = 1e-5
COEFF = "0.01"


def ds_args(dump: Path, *extra: str, steps: int = 2) -> list[str]:
    """DeepSeek V3 debug, fp32, seq 64, global batch 2, the balance loss on, clipping off."""
    return ["--config", "deepseek_debug.toml", "--moe.aux_loss_coeff", COEFF, "--training.seq_len", "64",
            "--training.local_batch_size", "2", "--training.global_batch_size", "2", "--training.steps", str(steps),
            "--optimizer.lr", "1e-4", "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1.0",
            "--training.max_norm", "0", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
            "--job.dump_folder", str(dump), *extra]


def _cp(method: str) -> list[str]:
    return ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", method]


CP_LAYOUTS = {  # name -> (world size, extra args)
    "cp2_allgather": (2, _cp("allgather")),
    "cp2_alltoall": (2, _cp("alltoall")),
    "cp2_tp2_sp": (4, [*_cp("allgather"), "--parallelism.tensor_parallel_degree", "2"]),
}


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.float() - ref.float()).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def _launch(root: Path, world: int) -> dict[str, dict]:
    cases = [{"name": n, "args": ds_args(root / n, *extra)} for n, (w, extra) in CP_LAYOUTS.items() if w == world]
    (root / f"cases{world}.json").write_text(json.dumps(cases))
    out = root / f"out{world}"
    torchrun(world, [str(root / f"cases{world}.json"), str(out)], module="tests.parallel_worker", timeout=900)
    return {c["name"]: torch.load(out / f"{c['name']}.stage0.pt", weights_only=False) for c in cases}


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_cp")
    losses, trainer = run_in_process(ds_args(root / "ref"))
    from tests.parallel_worker import gather_state

    _, grads = gather_state(trainer.model_parts, with_grads=True)
    ref = {"losses": losses, "grads": grads}
    return ref, {**_launch(root, 2), **_launch(root, 4)}


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", list(CP_LAYOUTS))
def test_sequence_aux_loss_under_cp_equals_one_rank(name, cp_runs):
    ref, runs = cp_runs
    got = runs[name]
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    assert len(got["losses"]) == len(ref["losses"]) == 2
    router = [k for k in ref["grads"] if k.endswith("router.gate.weight")]
    assert router and set(got["grads"]) == set(ref["grads"])
    grad = max(_rel(got["grads"][k], ref["grads"][k]) for k in ref["grads"])
    print(f"\n{name}: loss rel {loss:.2e}, grad rel {grad:.2e} (router: "
          f"{max(_rel(got['grads'][k], ref['grads'][k]) for k in router):.2e})")
    assert loss <= TOL, (got["losses"], ref["losses"])
    assert grad <= TOL


def _biases(trainer) -> list[torch.Tensor]:
    return [b.clone() for part in trainer.model_parts for n, b in part.named_buffers() if n.endswith("expert_bias")]


@pytest.mark.timeout(300)
def test_bias_update_counts_training_forwards_only(tmp_path):
    """Validation forwards do not feed the expert loads: the routing bias after 3 steps is
    the same with validation every step and without it (issue 19: it was not)."""
    toml = tmp_path / "ds_val.toml"
    toml.write_text((Path(__file__).parent.parent / "train_configs" / "deepseek_debug.toml").read_text()
                    + '\n[[validation.sources]]\ntype = "synthetic"\n')
    common = ["--moe.aux_loss_coeff", "0", "--training.steps", "3", "--validation.freq", "1",
              "--validation.steps", "2"]
    _, off = run_in_process(ds_args(tmp_path / "off", *common, "--config", str(toml)))
    _, on = run_in_process(ds_args(tmp_path / "on", *common, "--config", str(toml), "--validation.enable", "true"))
    assert on.validator is not None and off.validator is None
    before, after = _biases(off), _biases(on)
    assert len(before) == 5 and any(b.abs().sum() > 0 for b in before)  # the bias moved
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(m.training for part in on.model_parts for m in part.modules())  # train mode after validation


# --------------------------------------------------------------------------- top-k normalisation


def _router(model: str, flavor: str, *extra: str):
    """The first MoE layer's router of `model` `flavor` as the config resolves it (no experts built)."""
    import importlib

    from models.common.moe import TopKRouter
    from trainer.config import load_config

    cfg = load_config(["--model.name", model, "--model.flavor", flavor, *extra])
    moe_args = importlib.import_module(f"models.{model}.model").moe_args_from(cfg.model_args)
    torch.manual_seed(0)
    router = TopKRouter(cfg.model_args.dim, moe_args)
    router.init_weights(0.02)
    return router, moe_args


@pytest.mark.parametrize("model,flavor,normalised", [
    ("deepseek_v3", "debug", True),    # sigmoid scores: normalised (V3), then x route_scale
    ("deepseek_v3", "16B", False),     # softmax scores (V2-Lite shape): the raw top-k probabilities
    ("qwen3", "debug_moe", True),      # softmax, norm_topk_prob
])
def test_topk_weights_normalisation_per_model(model, flavor, normalised):
    """Row "top-k weights": each model's own rule, and `--moe.route_norm` overrides it."""
    for override, expect in ((None, normalised), (str(not normalised).lower(), not normalised)):
        router, moe_args = _router(model, flavor, *(("--moe.route_norm", override) if override else ()))
        x = torch.randn(32, router.gate.in_features)
        with torch.no_grad():
            weights, ids, scores = router(x)
        raw = scores.gather(1, ids) * moe_args.route_scale
        sums = weights.sum(dim=-1)
        if expect:
            assert torch.allclose(sums, torch.full_like(sums, moe_args.route_scale), rtol=1e-6)
            assert not torch.allclose(weights, raw)
        else:
            assert torch.equal(weights, raw) and (sums - moe_args.route_scale).abs().min() > 1e-3


# --------------------------------------------------------------------------- dropless routing


def _swiglu(x, w1, w2, w3):
    return (torch.nn.functional.silu(x @ w1) * (x @ w3)) @ w2


@pytest.mark.parametrize("grouped", [False, True])
def test_routing_is_dropless_at_any_load(grouped):
    """Row "dropless": every (token, pick) runs through its expert, however uneven the loads.
    With biases that send every token to the same two experts (6 idle), and with a skew
    that leaves loads uneven, the MoE output equals the per-token sum of its k experts'
    outputs (weighted) plus the shared expert, and the counted loads add up to tokens x k."""
    from models.common.moe import MoE, MoEArgs

    torch.manual_seed(0)
    moe = MoE(32, 48, MoEArgs(num_experts=8, top_k=2, num_shared_experts=1, score_func="sigmoid",
                              use_grouped_mm=grouped))
    moe.init_weights(0.1, 0.1)
    x = torch.randn(2, 40, 32)  # 80 tokens
    for bias in ([5.0, 5.0, 0, 0, 0, 0, 0, 0], [0.3, 0.2, 0.1, 0, 0, 0, -5.0, -5.0]):
        moe.expert_bias.copy_(torch.tensor(bias))
        moe.tokens_per_expert.zero_()
        out = moe(x)
        flat = x.reshape(-1, 32)
        weights, ids, _ = moe.route(flat)
        e = moe.experts
        ref = torch.stack([sum(weights[t, j] * _swiglu(flat[t], e.w1[ids[t, j]], e.w2[ids[t, j]], e.w3[ids[t, j]])
                               for j in range(2)) for t in range(flat.shape[0])]) + moe.shared_experts(flat)
        loads = moe.tokens_per_expert
        print(f"\nbias {bias}: loads {loads.tolist()}")
        assert int(loads.sum()) == 80 * 2 and (loads == torch.bincount(ids.flatten(), minlength=8)).all()
        assert loads.max() >= 40  # uneven: one expert takes at least half of the tokens
        torch.testing.assert_close(out.reshape(-1, 32), ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- aux-loss scopes (one layer)


def _aux(moe, x, **kw) -> torch.Tensor:
    moe.zero_grad()
    moe.aux_loss_count_reduce = kw.get("count_reduce")
    moe(x)
    return moe.aux_loss.clone()


class _Counts:
    """A stand-in for parallelisms/sequence_shards.py's count reduce on one rank: returns the
    counts summed over every rank (`total`) and the number of slices; `batch_slices` is how
    many data ranks' forwards the batch scope's one group spans."""

    def __init__(self, total, slices: int, batch_slices: int = 1):
        self.total, self.slices, self.batch_slices = total, slices, batch_slices

    def __call__(self, counts):
        return self.total, self.slices


@pytest.mark.parametrize("scope", ["sequence", "batch"])
def test_aux_loss_scope_of_one_forward(scope):
    """Rows "sequence aux loss" and "batch aux loss", on one layer, against the definitions:
    with G sequences per optimizer step, a forward of b sequences of S tokens adds
    sequence: coeff / G x sum over its sequences of sum_i f_i P_i (each sequence's own f, P);
    batch:    coeff x b / G x sum_i f_i P_i over all b x S tokens (one f, P for the forward).
    f_i = E / (K T) x picks of expert i among T tokens; P_i = mean normalised score of i.
    So splitting a forward in two forwards on one rank (accumulation, PP microbatches) keeps
    the sequence loss and changes the batch loss; a sequence split over ranks (CP, SP), whose
    pick counts are summed over the slices (`aux_loss_count_reduce`), gives the whole
    forward's loss, and so does, for the batch scope, a batch split over data ranks whose
    counts are summed over the dp mesh (`add_batch_shard_mesh`)."""
    from models.common.moe import MoE, MoEArgs

    torch.manual_seed(0)
    coeff, G, E, K = 0.5, 4, 8, 2
    moe = MoE(16, 16, MoEArgs(num_experts=E, top_k=K, num_shared_experts=0, score_func="softmax",
                              aux_loss_coeff=coeff, aux_loss_scope=scope, use_grouped_mm=False))
    moe.init_weights(0.5, 0.1)
    moe.aux_loss_scale = 1.0 / G
    x = torch.randn(2, 12, 16)

    @torch.no_grad()
    def by_hand(xs: torch.Tensor) -> float:  # xs [T, D]: one f, P over these tokens
        _, ids, scores = moe.route(xs)
        f = torch.bincount(ids.flatten(), minlength=E) * E / (K * xs.shape[0])
        return float((f * scores.mean(dim=0)).sum())

    whole = _aux(moe, x).item()
    if scope == "sequence":
        assert whole == pytest.approx(coeff / G * (by_hand(x[0]) + by_hand(x[1])), rel=1e-5)
    else:
        assert whole == pytest.approx(coeff * 2 / G * by_hand(x.reshape(-1, 16)), rel=1e-5)
    split = _aux(moe, x[:1]).item() + _aux(moe, x[1:]).item()  # two forwards of one sequence
    if scope == "sequence":
        assert split == pytest.approx(whole, rel=1e-6)
    else:
        assert abs(split - whole) > 1e-3 * whole  # the batch scope is per forward

    # Each sequence cut in two slices, as CP / SP ranks hold it: counts summed over the slices.
    halves = [x[:, :6], x[:, 6:]]
    picks = []

    def collect(counts):
        picks.append(counts)
        return counts, 2

    for h in halves:
        _aux(moe, h, count_reduce=collect)
    total = picks[0] + picks[1]
    sliced = sum(_aux(moe, h, count_reduce=_Counts(total, 2)).item() for h in halves)
    assert sliced == pytest.approx(whole, rel=1e-5)

    if scope == "batch":  # one sequence on each of 2 data ranks, counts summed over dp
        rows = [x[:1], x[1:]]
        picks.clear()
        for r in rows:
            _aux(moe, r, count_reduce=collect)
        total = picks[0] + picks[1]
        over_dp = sum(_aux(moe, r, count_reduce=_Counts(total, 2, batch_slices=2)).item() for r in rows)
        assert over_dp == pytest.approx(whole, rel=1e-5)


# --------------------------------------------------------------------------- config fields


def test_moe_fields_reach_the_model_and_bad_values_are_one_line():
    """Every changeable behaviour is a [moe] field (default: the model's own), validated once."""
    from models.deepseek_v3.model import moe_args_from as ds_moe
    from models.qwen3.model import moe_args_from as qwen_moe
    from trainer.config import load_config
    from configuration.fields import ConfigError

    ds = ["--model.name", "deepseek_v3", "--model.flavor", "debug"]
    qw = ["--model.name", "qwen3", "--model.flavor", "debug_moe"]
    assert ds_moe(load_config(ds).model_args).aux_loss_scope == "sequence"
    assert qwen_moe(load_config(qw).model_args).aux_loss_scope == "batch"
    a = ds_moe(load_config(ds + ["--moe.aux_loss_scope", "batch", "--moe.route_norm", "false",
                                 "--moe.bias_update_rate", "0", "--moe.aux_loss_coeff", "0.1"]).model_args)
    assert (a.aux_loss_scope, a.route_norm, a.aux_loss_coeff) == ("batch", False, 0.1)
    assert load_config(ds + ["--moe.bias_update_rate", "0"]).model_args.load_balance_coeff == 0
    for args, message in [
        (qw + ["--moe.aux_loss_scope", "global"], "config error: moe.aux_loss_scope: 'global' is not one of sequence, batch"),
        (["--model.name", "qwen3", "--model.flavor", "debug", "--moe.route_norm", "true"],
         "config error: moe.route_norm: qwen3 debug has no mixture-of-experts layers; drop it"),
        (["--moe.aux_loss_coeff", "0.1"], "config error: moe.aux_loss_coeff: llama3 debug has no mixture-of-experts"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(args)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- one launch: loads, bias, scopes

_COMMON = ["--training.seq_len", "32", "--training.global_batch_size", "4", "--training.steps", "2",
           "--training.mixed_precision_param", "float32", "--optimizer.lr", "1e-3", "--optimizer.eps", "1e-4",
           "--lr_scheduler.warmup_steps", "0", "--training.max_norm", "0", "--metrics.log_freq", "1",
           "--metrics.enable_tensorboard", "false", "--data.type", "synthetic"]
# DeepSeek `ep_test` (1 dense + 2 MoE blocks, 8 experts top 2), bias update on, sequence aux loss on.
_DS = ["--model.name", "deepseek_v3", "--model.flavor", "ep_test", "--moe.aux_loss_coeff", COEFF, *_COMMON]
# Qwen3 debug_moe (batch-scope aux loss, no bias update) at a coefficient where the loss matters.
_QW = ["--model.name", "qwen3", "--model.flavor", "debug_moe", "--moe.aux_loss_coeff", "2.0", *_COMMON,
       "--training.global_batch_size", "2"]
_LB = "--training.local_batch_size"
_CP2 = ["--parallelism.context_parallel_degree", "2"]
_TP2 = ["--parallelism.tensor_parallel_degree", "2"]

# name -> (args, loads factor vs one rank): the loads behind every bias update, summed over dp x cp x tp.
DS_LAYOUTS = {
    "ds_fsdp2": ([_LB, "2"], 1),
    "ds_cp2": ([_LB, "4", *_CP2], 1),
    "ds_tp2_sp": ([_LB, "4", *_TP2], 1),
    "ds_tp2_nosp": ([_LB, "4", *_TP2, "--parallelism.enable_sequence_parallel", "false"], 2),  # same tokens twice
    "ds_pp2": ([_LB, "4", "--parallelism.pipeline_parallel_degree", "2"], 1),  # 4 microbatches, per stage
    "ds_ep2": ([_LB, "2", "--parallelism.expert_parallel_degree", "2"], 1),
}
QW_LAYOUTS = {
    "qw_fsdp2": [_LB, "1"],  # one sequence per rank, pick counts summed over dp: the one-rank forward of 2
    "qw_cp2": [_LB, "2", *_CP2],  # whole sequences (counts summed over cp): the one-rank forward of 2
    "qw_pp2": [_LB, "2", "--parallelism.pipeline_parallel_degree", "2"],  # 2 microbatches of 1, each its own counts
}


def _stages(out: Path, name: str) -> dict:
    """The per-stage records of one case merged: loads concatenated over stages (layer order)."""
    recs = [torch.load(p, weights_only=False) for p in sorted(out.glob(f"{name}.stage*.pt"))]
    assert recs, name
    merged = {"losses": recs[-1]["losses"], "grads": {}, "buffers": {},
              "loads": [torch.cat([r["loads"][i] for r in recs]) for i in range(len(recs[0]["loads"]))]}
    for r in recs:
        merged["grads"].update(r["grads"])
        merged["buffers"].update(r["buffers"])
    return merged


@pytest.fixture(scope="module")
def semantics_runs(tmp_path_factory):
    """One-rank references in this process, then every layout in one 2-rank launch."""
    from tests.moe_semantics_worker import train

    root = tmp_path_factory.mktemp("moe_semantics")
    ref = {name: train(args + ["--job.dump_folder", str(root / name)])[0] for name, args in {
        "ds": _DS + [_LB, "4"],
        "ds_accum4": _DS + [_LB, "1"],
        "ds_ac_full": _DS + [_LB, "4", "--activation_checkpoint.mode", "full"],
        "qw_batch2": _QW + [_LB, "2"],
        "qw_accum2": _QW + [_LB, "1"],
    }.items()}
    cases = [{"name": n, "args": _DS + extra + ["--job.dump_folder", str(root / n)]}
             for n, (extra, _) in DS_LAYOUTS.items()]
    cases += [{"name": n, "args": _QW + extra + ["--job.dump_folder", str(root / n)]} for n, extra in QW_LAYOUTS.items()]
    (root / "cases.json").write_text(json.dumps(cases))
    torchrun(2, [str(root / "cases.json"), str(root / "out")], module="tests.moe_semantics_worker", timeout=900)
    return ref, {c["name"]: _stages(root / "out", c["name"]) for c in cases}


def _grad_rel(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys()
    return max(_rel(got[k], ref[k]) for k in ref)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bias_update_loads_and_reduction_per_layout(semantics_runs):
    """Rows "bias update": after every optimizer step, from the loads of that step's training
    forwards (every microbatch; the pipeline's shape-inference pass and validation excluded),
    summed over dp x cp x tp (each pipeline stage its own layers; EP borrows dp ranks). The
    loads equal one rank's exactly (twice them with TP without SP, where both TP ranks route
    the same tokens, and with full AC, whose recompute routes again: a per-layer factor that
    sign(mean - load) ignores), and so does the bias after 2 steps."""
    ref, runs = semantics_runs
    base = ref["ds"]
    assert len(base["loads"]) == 2 and base["loads"][0].shape == (2, 8) and int(base["loads"][0].sum()) == 2 * 4 * 32 * 2
    assert any(b.abs().sum() > 0 for b in base["buffers"].values())  # the bias moved
    checks = {**{n: (runs[n], f) for n, (_, f) in DS_LAYOUTS.items()},
              "ds_accum4": (ref["ds_accum4"], 1), "ds_ac_full": (ref["ds_ac_full"], 2)}
    for name, (got, factor) in checks.items():
        loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], base["losses"]))
        print(f"\n{name}: loads x{factor} {'==' if all(torch.equal(g, factor * r) for g, r in zip(got['loads'], base['loads'])) else '!='} one rank; "
              f"loss rel {loss:.1e}")
        assert len(got["loads"]) == 2 and all(torch.equal(g, factor * r) for g, r in zip(got["loads"], base["loads"]))
        assert got["buffers"].keys() == base["buffers"].keys()
        assert all(torch.equal(got["buffers"][k], base["buffers"][k]) for k in base["buffers"])
        assert loss <= TOL


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_aux_loss_scopes_per_layout(semantics_runs):
    """Rows "sequence aux loss" and "batch aux loss" end to end (Qwen3 debug_moe, the loss at
    coefficient 2). Batch scope: one group per forward over the data ranks, so FSDP 2 with one
    sequence per rank (counts summed over dp) equals one rank's single forward of 2, and so
    does CP 2 (each rank half of both sequences); PP 2 (2 microbatches of 1) equals one rank
    accumulating 2 microbatches of 1, and the two cuts differ. DeepSeek's sequence scope under
    dp, tp with SP, pp, ep and accumulation is tests/test_moe_balance.py; under CP,
    test_sequence_aux_loss_under_cp_equals_one_rank above."""
    ref, runs = semantics_runs
    apart = _grad_rel(ref["qw_accum2"]["grads"], ref["qw_batch2"]["grads"])
    print(f"\nbatch scope: 2 forwards of 1 vs 1 forward of 2, grads rel {apart:.2e}")
    assert apart > 1e-3  # the scope matters at this coefficient
    for name, want in (("qw_fsdp2", "qw_batch2"), ("qw_cp2", "qw_batch2"), ("qw_pp2", "qw_accum2")):
        got, exp = runs[name], ref[want]
        loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], exp["losses"]))
        grad = _grad_rel(got["grads"], exp["grads"])
        print(f"{name} vs {want}: loss rel {loss:.1e}, grad rel {grad:.1e}")
        assert loss <= TOL and grad <= TOL


@pytest.mark.timeout(300)
def test_a_skipped_step_leaves_no_loads_behind(tmp_path):
    """Row "bias update": a step the step guard skips (non-finite gradient norm) updates no
    bias, and its loads are dropped, so the next update counts only its own step's tokens
    (before, they were added to the next step's: two steps' routing steered one update)."""
    from tests.moe_semantics_worker import recording_loads
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(_DS + [_LB, "4", "--training.steps", "3", "--job.dump_folder", str(tmp_path)]))
    original = trainer.forward_backward

    def forward_backward(batches):
        loss = original(batches)
        if trainer.step == 2:
            next(trainer.model_parts[0].parameters()).grad.view(-1)[0] = float("nan")
        return loss

    trainer.forward_backward = forward_backward
    biases = lambda: [b.clone() for n, b in trainer.model_parts[0].named_buffers() if n.endswith("expert_bias")]  # noqa: E731
    seen = {}
    step = trainer.train_step

    def train_step(batches, **kw):
        result = step(batches, **kw)
        seen[trainer.step] = (result.skipped, biases())
        return result

    trainer.train_step = train_step
    with recording_loads() as loads:
        try:
            trainer.train()
        finally:
            trainer.close()
    assert seen[2][0] == "non-finite gradient norm" and seen[1][0] is None and seen[3][0] is None
    assert all(torch.equal(a, b) for a, b in zip(seen[1][1], seen[2][1]))  # no bias update at step 2
    assert len(loads) == 2  # steps 1 and 3
    per_step = 4 * 32 * 2  # sequences x tokens x top-k, per MoE layer
    assert [[int(v) for v in step_loads.sum(dim=1)] for step_loads in loads] == [[per_step] * 2] * 2
