"""torchft replica groups with MoE models, FSDP inside each group and Muon: real torchft, a real
lighthouse, gloo, each launch under a hard timeout.

- DeepSeek V3 debug (2 groups x 2 ranks, FSDP 2 inside) and Qwen3-MoE debug (2 groups x 1 rank; its
  per-layer batch-scope balance loss, and HF's loss pooled over the layers, `aux_loss_scope = "model"`,
  whose pick counts are summed over the groups as over HSDP's data ranks)
  against plain HSDP on the same global batch, 10 steps: losses within 1e-5; every logged expert
  load equal to HSDP's, which sums the loads over all data ranks (a group that summed only its own
  moved its expert bias from its own data slice, and routing drifted apart between groups); at the
  end the groups are bitwise equal, expert bias included. The bias update is a function of the
  global loads alone, so equal loads at every step are HSDP's bias.
- DeepSeek V3 debug with Muon, 2 groups x 2 ranks: rank 1 of group 1 hangs (SIGSTOP); its group's
  hang watch ends it, the healthy group waits at the quorum (min_replicas 2) instead of crashing
  when its quorum times out, logs every step once, and the restarted group heals from it: every
  rank's parameters (expert bias included) and optimizer state (Muon momentum, AdamW moments) end
  bitwise equal across the groups.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ft_helpers import ENV, Proc, assert_groups_bitwise_equal, losses, start_group, start_lighthouse
from tests.helpers import read_metrics

SHORT = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
         "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "2"]
MODELS = {  # config, ranks per group, extra arguments
    "deepseek": ("deepseek_debug.toml", 2, []),
    "qwen3_moe": ("qwen3_moe_debug.toml", 1, []),  # the debug flavor's per-layer batch-scope balance loss
    "qwen3_pooled": ("qwen3_moe_debug.toml", 1, ["--moe.aux_loss_scope", "model"]),  # HF's, pooled over layers
}


def _moe_metrics(folder: Path) -> dict[int, dict[str, float]]:
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("moe/")} for r in read_metrics(folder)}


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_moe_groups_keep_one_routing_and_match_hsdp(tmp_path):
    procs: dict[str, list[Proc]] = {}
    lighthouses = []
    try:
        for name, (config, ranks, extra) in MODELS.items():
            args = ["--config", config, *SHORT, *extra, "--training.steps", "10"]
            procs[f"{name}-hsdp"] = [Proc(["./run_train.sh", *args, "--parallelism.data_parallel_replicate_degree",
                                           "2", "--job.dump_folder", str(tmp_path / name / "hsdp")],
                                          {**ENV, "NGPU": str(2 * ranks)})]
            (tmp_path / name).mkdir()
            lighthouse, address = start_lighthouse(tmp_path / name, min_replicas=2)
            lighthouses.append(lighthouse)
            ft = [*args, "--fault_tolerance.group_count", "2", "--fault_tolerance.min_replicas", "2",
                  "--fault_tolerance.lighthouse", address, "--job.dump_folder", str(tmp_path / name / "ft")]
            procs[f"{name}-ft"] = [start_group(g, ranks, ft, {"TITAN_TEST_FT_STATE": str(tmp_path / name / "state")})
                                   for g in (0, 1)]
        for key, group in procs.items():
            for p in group:
                assert p.wait(800) == 0, (key, p.text()[-4000:])
    finally:
        for p in [*lighthouses, *(p for group in procs.values() for p in group)]:
            p.kill()

    for name, (_, ranks, _) in MODELS.items():
        hsdp_loss, hsdp_loads = losses(tmp_path / name / "hsdp"), _moe_metrics(tmp_path / name / "hsdp")
        assert sorted(hsdp_loss) == list(range(1, 11)) and hsdp_loads[10], name
        for g in (0, 1):
            folder = tmp_path / name / "ft" / f"replica-{g}"
            records = read_metrics(folder)
            assert [r["step"] for r in records] == list(range(1, 11)) and all(r["ft/groups"] == 2 for r in records)
            for step, loss in losses(folder).items():
                assert loss == pytest.approx(hsdp_loss[step], rel=0, abs=1e-5), (name, g, step)
            # The loads every group used for its bias update (and logs) are the global ones, as in HSDP.
            assert _moe_metrics(folder) == hsdp_loads, (name, g)
        states = assert_groups_bitwise_equal(tmp_path / name / "state", ranks)
        bias = [t for n, t in zip(states[0]["model_names"][0], states[0]["model"][0]) if n.endswith("expert_bias")]
        assert bias, name
        if name == "deepseek":  # aux-loss-free balancing moved the bias (Qwen3-MoE has none: coeff 0)
            assert any(t.abs().max() > 0 for t in bias)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_a_hung_rank_ends_its_group_the_other_waits_and_it_heals_bitwise(tmp_path):
    steps = 6
    args = ["--config", "deepseek_debug.toml", *SHORT, "--training.steps", str(steps), "--optimizer.name", "muon",
            "--optimizer.muon_params", "layers.1.*",  # Muon on one block (attention and experts): fast on CPU
            "--fault_tolerance.group_count", "2", "--fault_tolerance.min_replicas", "2",
            "--fault_tolerance.quorum_timeout_seconds", "4", "--fault_tolerance.heal_timeout_seconds", "5",
            "--comm.train_timeout_seconds", "10", "--job.dump_folder", str(tmp_path / "ft")]
    state = {"TITAN_TEST_FT_STATE": str(tmp_path / "state")}
    lighthouse, address = start_lighthouse(tmp_path, min_replicas=2)
    args += ["--fault_tolerance.lighthouse", address]
    procs = []
    try:
        survivor = start_group(0, 2, args, state)
        hung = start_group(1, 2, args, {**state, "TITAN_TEST_STOP_RANK": "1@3"})
        procs += [survivor, hung]
        assert hung.wait(400) == 3, hung.text()[-4000:]  # HANG_EXIT: its own hang watch named rank 1
        assert "hang: rank 1" in hung.text(), hung.text()[-4000:]
        survivor.wait_for(r"no quorum at step \d+ after", 120)  # it waits for the quorum, alive
        restarted = start_group(1, 2, args, state)
        procs.append(restarted)
        assert survivor.wait(400) == 0, survivor.text()[-4000:]
        assert restarted.wait(200) == 0, restarted.text()[-4000:]
    finally:
        for p in [lighthouse, *procs]:
            p.kill()
    assert "Traceback" not in survivor.text(), survivor.text()[-4000:]
    assert [r["step"] for r in read_metrics(tmp_path / "ft" / "replica-0")] == list(range(1, steps + 1))
    assert "healed from a live peer at step 2" in restarted.text(), restarted.text()[-4000:]
    states = assert_groups_bitwise_equal(tmp_path / "state", ranks=2)
    assert states[0]["step"] == steps
    momentum = [s for s in states[0]["optimizers"][0] if "momentum_buffer" in s]
    assert momentum and all(s["momentum_buffer"].abs().max() > 0 for s in momentum)  # Muon's state, healed
