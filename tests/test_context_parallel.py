"""Context parallelism, unit level: the load-balanced layout, layout checks, and the CP
attention (allgather, alltoall) against full causal attention on real gloo ranks.

Attention cases run in fp64 (tolerance 1e-10) as cases of one torchrun launch per CP
degree (tests/cp_attention_worker.py). Training parity with a 1-process run is in
tests/test_context_parallel_train.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from parallelisms.context_parallel import check_context_parallel_layout, kv_repeat_for_alltoall
from parallelisms.context_parallel_comm import (
    local_positions, natural_order, rank_order, reorder_chunks, shard_sequence, unshard_sequence)
from tests.helpers import torchrun
from configuration.fields import ConfigError


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_head_tail_layout(cp):
    seq = 2 * cp * 3
    x = torch.arange(seq).view(1, seq)
    shards = [shard_sequence(x, cp, r) for r in range(cp)]
    for r, s in enumerate(shards):
        c = seq // (2 * cp)
        assert s[0].tolist() == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        assert torch.equal(s[0], local_positions(seq, cp, r))
    assert torch.equal(unshard_sequence(shards), x)
    # every rank does the same causal work: sum over its positions of (position + 1)
    work = {int((local_positions(seq, cp, r) + 1).sum()) for r in range(cp)}
    assert len(work) == 1
    rank_ordered = torch.cat(shards, dim=1)
    assert torch.equal(reorder_chunks(rank_ordered, natural_order(cp), dim=1), x)
    assert torch.equal(reorder_chunks(x, rank_order(cp), dim=1), rank_ordered)


class _Args:
    def __init__(self, n_heads, n_kv_heads=None):
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads


def test_layout_checks():
    check_context_parallel_layout(_Args(4, 2), cp=2, tp=1, method="allgather", seq_len=64, sequence_parallel=False)
    with pytest.raises(ConfigError, match=r"training.seq_len: 60 is not divisible by 2 x context_parallel_degree = 8"):
        check_context_parallel_layout(_Args(4), cp=4, tp=1, method="allgather", seq_len=60, sequence_parallel=False)
    with pytest.raises(ConfigError, match=r"seq_len / cp = 12 is not divisible by tensor_parallel_degree 8"):
        check_context_parallel_layout(_Args(8), cp=2, tp=8, method="allgather", seq_len=24, sequence_parallel=True)
    # 4 heads / tp 2 = 2 local heads: alltoall over cp 4 cannot split them; allgather can
    with pytest.raises(ConfigError, match=r"alltoall splits the 2 local attention heads .*degree 4"):
        check_context_parallel_layout(_Args(4, 2), cp=4, tp=2, method="alltoall", seq_len=64, sequence_parallel=True)
    check_context_parallel_layout(_Args(4, 2), cp=4, tp=2, method="allgather", seq_len=64, sequence_parallel=True)


def test_kv_repeat_for_alltoall():
    assert kv_repeat_for_alltoall(32, 8, 4) == 1
    assert kv_repeat_for_alltoall(4, 2, 4) == 2  # debug_small at cp 4: KV heads doubled, not quadrupled
    assert kv_repeat_for_alltoall(32, 1, 8) == 8
    assert kv_repeat_for_alltoall(6, 3, 4) is None  # 6 q heads do not split over 4
    assert kv_repeat_for_alltoall(8, 2, 8) == 4


# name -> case. hq/hkv: GQA (4/2), MHA (4/4), MLA-like (dk 24 != dv 16, explicit scale).
def _cases(cp: int) -> list[dict]:
    seq = 2 * cp * 3  # an odd number of tokens per chunk
    base = {"seq": seq, "dk": 16, "dv": 16, "hq": 4, "hkv": 2}
    cases = []
    for method in ("allgather", "alltoall"):
        cases += [
            {**base, "name": f"{method}_gqa", "method": method},
            {**base, "name": f"{method}_mha", "method": method, "hkv": 4},
            {**base, "name": f"{method}_mla", "method": method, "hkv": 4, "dk": 24, "dv": 16, "scale": 0.3},
            {**base, "name": f"{method}_gqa_ac_op", "method": method, "ac": "op"},
            {**base, "name": f"{method}_gqa_ac_full", "method": method, "ac": "full"},
        ]
    return cases


@pytest.mark.multirank
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_matches_full_attention(cp, tmp_path):
    cases = _cases(cp)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    torchrun(cp, [str(tmp_path / "cases.json"), str(tmp_path / "out")], module="tests.cp_attention_worker",
             timeout=240)
    for case in cases:
        r = json.loads((tmp_path / "out" / f"{case['name']}.json").read_text())
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] < 1e-10, (case["name"], key, r)
        # allgather: one gather forward (K and V packed), one reduce-scatter backward;
        # alltoall: two all-to-alls each way (q/k/v packed in, output out).
        fwd = {"allgather": 1, "alltoall": 2}[case["method"]]
        assert r["fwd_calls"] == fwd, (case["name"], r)
        bwd = r["bwd_calls"]
        # Full AC re-runs the gather / the first all-to-all (the recompute stops early, before the
        # output all-to-all, whose backward needs nothing saved); op SAC saved them: no collective.
        recomputed = 1 if case.get("ac") == "full" else 0
        if case["method"] == "allgather":
            assert bwd == {"all_gather": recomputed, "reduce_scatter": 1, "all_to_all": 0}, (case["name"], bwd)
        else:
            assert bwd == {"all_gather": 0, "reduce_scatter": 0, "all_to_all": 2 + recomputed}, (case["name"], bwd)
        b, c = 2, case["seq"] // (2 * cp)
        if case["method"] == "allgather":  # K and V of every token, fp64, (cp-1)/cp of it from peers
            expect = b * case["hkv"] * case["seq"] * (case["dk"] + case["dv"]) * 8 * (cp - 1) / cp
        else:  # local q, k, v (KV repeated to divide) in, local output back
            hkv = case["hkv"] * kv_repeat_for_alltoall(case["hq"], case["hkv"], cp)
            local = b * 2 * c
            expect = local * (case["hq"] * case["dk"] + hkv * (case["dk"] + case["dv"]) + case["hq"] * case["dv"]) \
                * 8 * (cp - 1) / cp
        assert r["fwd_wire_bytes"] == pytest.approx(expect), case["name"]


# Whole models with the CP plan vs unsharded (fp32): Llama debug_small (GQA 4/2, 3 layers)
# and DeepSeek V3 debug (MLA: allgather gathers the latent at attention.kv_latent).
# With AC (op / full), the backward's collectives are counted: op SAC saves the CP ops, so the
# recompute sends nothing (AC_TRACE=1 shows them saved).
# DeepSeek runs under op SAC only (its parity covers the plan; the save set covers the latent gather).
MODEL_CASES = [
    {"name": f"{model}_{method}_ac_{ac}", "model": model, "flavor": flavor, "method": method, "seq": 48, "ac": ac}
    for model, flavor, modes in (("llama3", "debug_small", ("none", "op", "full")), ("deepseek_v3", "debug", ("op",)))
    for method in ("allgather", "alltoall") for ac in modes
]


@pytest.mark.multirank
def test_cp_plan_on_models_matches_unsharded(tmp_path):
    cp = 2
    (tmp_path / "cases.json").write_text(json.dumps(MODEL_CASES))
    proc = torchrun(cp, [str(tmp_path / "cases.json"), str(tmp_path / "out")], module="tests.cp_attention_worker",
                    timeout=240, env={"AC_TRACE": "1"})
    for op in ("cp_all_gather", "cp_all_to_all"):
        assert f"AC_TRACE SAVE titanlite.{op}.default" in proc.stdout, proc.stdout[-3000:]
    for case in MODEL_CASES:
        r = json.loads((tmp_path / "out" / f"{case['name']}.json").read_text())
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5, (case["name"], r)
        n_layers = 3 if case["model"] == "llama3" else 6
        kinds = {name.rsplit(".", 1)[-1] for name in r["replaced"]}
        if case["model"] == "deepseek_v3" and case["method"] == "allgather":
            assert kinds == {"sdpa", "kv_latent"} and len(r["replaced"]) == 2 * n_layers
            # the latent of every token: kv_lora_rank 64 + rope 16 fp32 values, (cp-1)/cp from peers
            assert r["fwd_wire_bytes"] == pytest.approx(n_layers * 2 * 48 * (64 + 16) * 4 / 2)
        else:
            assert kinds == {"sdpa"} and len(r["replaced"]) == n_layers
        per_layer = 1 if case["method"] == "allgather" else 2
        assert r["fwd_calls"] == n_layers * per_layer
        # Backward: the autograd collectives (one reduce-scatter per gather; the reverse of both
        # all-to-alls), plus, under full AC only, the recompute's (the whole block: every one);
        # op SAC recomputes none.
        recomputed = n_layers * per_layer if case["ac"] == "full" else 0
        if case["method"] == "allgather":
            expect = {"all_gather": recomputed, "reduce_scatter": n_layers, "all_to_all": 0}
        else:
            expect = {"all_gather": 0, "reduce_scatter": 0, "all_to_all": 2 * n_layers + recomputed}
        assert r["bwd_calls"] == expect, (case["name"], r["bwd_calls"])


@pytest.mark.parametrize("config", ["llama8b_128k.toml", "llama_debug_cp.toml"])
def test_cp_configs_pass_dry_run(config, capsys):
    from trainer.config import load_config
    from trainer.config import print_model_summary

    cfg = load_config(["--config", config, "--job.dry_run"])  # layout validation runs here
    assert cfg.parallelism.context_parallel_degree > 1
    assert print_model_summary(cfg)["params"] > 0 and "parameters:" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_train_sh_trains_llama_debug_cp(tmp_path):
    """The command the docs give: NGPU=2 ./run_train.sh --config llama_debug_cp.toml (3 steps here)."""
    import os

    from tests.helpers import REPO, read_metrics, run_killing_group

    env = {**os.environ, "NGPU": "2", "LOG_RANK": "0"}
    proc = run_killing_group(["./run_train.sh", "--config", "llama_debug_cp.toml", "--training.steps", "3",
                              "--job.dump_folder", str(tmp_path / "run")], cwd=REPO, env=env, timeout=550)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cp 2" in proc.stdout
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] and 0 < r["loss"] < 10 for r in records), records
    assert records[-1]["loss"] < records[0]["loss"]
