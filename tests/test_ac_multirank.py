"""Every AC mode under 2-rank FSDP2 (gloo, CPU) matches a 1-process run within 1e-5.

One spawn runs all the modes (each process pays ~5 s to import torch), a dense Llama
and a MoE DeepSeek, for 3 optimizer steps each. Rank 0 writes the losses and the full
(unsharded) gradients; the test compares them with an unsharded, un-checkpointed run.
The same spawn runs Llama under FSDP2's bf16 mixed precision (bf16 params, fp32 reduce:
what every multi-GPU run gets), where `op` and `full` must take the direct recompute from
step 3 and equal `none` under the same precision bitwise.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.helpers import free_port

WORLD = 2
STEPS = 3
CASES = [("llama3", "none"), ("llama3", "full"), ("llama3", "selective"), ("llama3", "op"),
         ("deepseek_v3", "full"), ("deepseek_v3", "op")]
BF16_CASES = [("llama3", "none", "bf16"), ("llama3", "op", "bf16"), ("llama3", "full", "bf16")]


def _build(name: str):
    torch.manual_seed(0)
    if name == "llama3":
        from models.llama3 import LLAMA3_FLAVORS, Llama3, spec
        model = Llama3(dataclasses.replace(LLAMA3_FLAVORS["debug_small"], vocab_size=256, max_seq_len=64))
    else:
        from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3, spec
        args = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debug"], dim=64, n_layers=2, n_dense_layers=1, inter_dim=128,
                                   moe_inter_dim=32, n_heads=4, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
                                   qk_rope_head_dim=8, v_head_dim=16, vocab_size=256, max_seq_len=64)
        model = DeepSeekV3(args)
    model.init_weights()
    return model, spec


def _batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 256, (2 * WORLD, 16), generator=g), torch.randint(0, 256, (2 * WORLD, 16), generator=g))
            for _ in range(STEPS)]


def _train(model, batches, rows=slice(None), paths=None, per_step=None):
    """Loss and full gradients per step. With `paths` (`ac_helpers.count_direct_paths`:
    "rebuilds" of a direct recompute, "reruns" of a block by torch's checkpoint), each step's
    counts are appended to `per_step`."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for tokens, labels in batches:
        opt.zero_grad(set_to_none=True)
        if paths is not None:
            paths.clear()
        loss = F.cross_entropy(model(tokens[rows]).flatten(0, 1).float(), labels[rows].flatten())
        loss.backward()
        if paths is not None:
            per_step.append((paths["rebuilds"], paths["reruns"]))
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[n.replace("_checkpoint_wrapped_module.", "")] = g.detach().clone()
        out.append((loss.detach().clone(), grads))
        opt.step()
    return out


def _worker(rank: int, port: int, out_path: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from parallelisms.activation_checkpoint import ActivationCheckpointConfig, apply_activation_checkpointing
    from tests.ac_helpers import count_direct_paths
    from trainer.distributed import exit_process

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        batches = _batches()
        results = {}
        paths = count_direct_paths()
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for name, mode, *precision in CASES + BF16_CASES:
            model, spec = _build(name)
            apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=mode), spec=spec)
            mp_policy = bf16 if precision else MixedPrecisionPolicy()
            for block in model.layers.values():
                fully_shard(block, mesh=mesh, mp_policy=mp_policy)
            fully_shard(model, mesh=mesh, mp_policy=mp_policy)
            per_step: list = []
            run = _train(model, batches, rows=slice(2 * rank, 2 * rank + 2), paths=paths, per_step=per_step)
            # Each rank's loss is its local mean; the global mean is their average.
            for loss, _ in run:
                dist.all_reduce(loss)
                loss /= WORLD
            results[(name, mode, *precision)] = run
            results[("paths", name, mode, *precision)] = per_step
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()
    exit_process(0)


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory):
    """What rank 0 of the 2-rank spawn wrote: per case its (loss, gradients) per step, and
    under ("paths", *case) its (direct rebuilds, torch's checkpoint re-runs) per step."""
    out_path = str(tmp_path_factory.mktemp("fsdp2") / "ranks.pt")
    ctx = mp.start_processes(_worker, args=(free_port(), out_path), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 200
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError("FSDP2 ranks did not finish in 200 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    return torch.load(out_path)


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_every_mode_under_fsdp2_matches_one_process(fsdp2_runs):
    got = {case: run for case, run in fsdp2_runs.items() if case in CASES}
    batches = _batches()
    refs = {name: _train(_build(name)[0], batches) for name in {n for n, _ in CASES}}
    for (name, mode), run in got.items():
        ref = refs[name]
        for step, ((l_ref, g_ref), (l_got, g_got)) in enumerate(zip(ref, run)):
            assert abs(l_ref.item() - l_got.item()) < 1e-5, (name, mode, step)
            assert g_ref.keys() == g_got.keys()
            for k in g_ref:
                torch.testing.assert_close(g_got[k], g_ref[k], rtol=0, atol=1e-5, msg=f"{name} {mode} step {step} {k}")
    # And the modes agree with each other (the checkpointing changed nothing).
    assert set(got) == set(CASES)
    # Llama's `op` and `full` blocks take the direct recompute from step 3 (calls 1 and 2 record
    # the block and build it; torch's checkpoint re-runs each block then).
    for mode in ("op", "full"):
        assert fsdp2_runs[("paths", "llama3", mode)] == [(0, 3), (0, 3), (3, 0)], mode


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_bf16_fsdp2_blocks_take_the_direct_recompute_bitwise(fsdp2_runs):
    """FSDP2 with bf16 params and fp32 reduce (every multi-GPU run's default): the residual
    stream entering a block is bf16, and only RMSNorm's `x.float()` and the residual add read
    it, neither of which packs it. The direct recompute was refused then ("a needed tensor is
    neither made in the block nor packed"), and every `op` block ran torch's checkpoint
    recompute; now its steps read the block's argument. From step 3 each of the 3 blocks
    rebuilds directly and torch's checkpoint re-runs none, and every step's loss and gradients
    equal `none`'s under the same precision bitwise."""
    ref = fsdp2_runs[("llama3", "none", "bf16")]
    assert fsdp2_runs[("paths", "llama3", "none", "bf16")] == [(0, 0)] * STEPS
    for mode in ("op", "full"):
        run = fsdp2_runs[("llama3", mode, "bf16")]
        assert fsdp2_runs[("paths", "llama3", mode, "bf16")] == [(0, 3), (0, 3), (3, 0)], mode
        for step, ((l_ref, g_ref), (l_got, g_got)) in enumerate(zip(ref, run, strict=True)):
            assert torch.equal(l_ref, l_got), (mode, step)
            assert g_ref.keys() == g_got.keys() and g_ref["tok_embeddings.weight"].dtype == torch.float32
            for k in g_ref:
                assert torch.equal(g_got[k], g_ref[k]), (mode, step, k)


# --------------------------------------------------------------------------- 4 ranks: FSDP inside
# a checkpointed block (EP 2 x FSDP 2) and sequence parallel (TP 2 x FSDP 2), through the trainer.

DS = ["--model.name", "deepseek_v3", "--model.flavor", "ep_test", "--parallelism.expert_parallel_degree", "2"]
LLAMA_TP = ["--model.name", "llama3", "--model.flavor", "debug_small", "--parallelism.tensor_parallel_degree", "2"]
LOCAL_BATCH, SEQ = 2, 64
DIST_CASES = {
    "ep2_fsdp2_none": [*DS, "--activation_checkpoint.mode", "none"],
    "ep2_fsdp2_op": [*DS, "--activation_checkpoint.mode", "op"],
    "tp2_sp_none": [*LLAMA_TP, "--activation_checkpoint.mode", "none"],
    "tp2_sp_op": [*LLAMA_TP, "--activation_checkpoint.mode", "op"],
    "tp2_sp_op_keep_all_gathers": [*LLAMA_TP, "--activation_checkpoint.mode", "op",
                                   "--activation_checkpoint.save_all_gathers", "true"],
}


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    import json

    from tests.helpers import torchrun

    root = tmp_path_factory.mktemp("ac4")
    common = ["--training.steps", "1", "--training.seq_len", str(SEQ), "--training.local_batch_size",
              str(LOCAL_BATCH), "--data.type", "synthetic", "--training.mixed_precision_param", "float32",
              "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1"]
    cases = [{"name": n, "args": [*common, "--job.dump_folder", str(root / n), *a]} for n, a in DIST_CASES.items()]
    (root / "cases.json").write_text(json.dumps(cases))
    torchrun(4, [str(root / "cases.json"), str(root / "out")], timeout=400, module="tests.ac_worker",
             env={"AC_TRACE": "1"})
    return {n: torch.load(root / "out" / f"{n}.pt", weights_only=False) for n in DIST_CASES}


def _assert_same_run(got: dict, ref: dict) -> None:
    assert got["losses"] == ref["losses"]
    assert got["grads"].keys() == ref["grads"].keys()
    for k in ref["grads"]:
        assert torch.equal(got["grads"][k], ref["grads"][k]), k


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(450)
def test_op_never_keeps_fsdp_all_gather_inside_a_block(dist_runs):
    """EP 2 x FSDP 2: the routed experts are an FSDP unit inside the checkpointed MoE block,
    all-gathered there with the legacy `c10d._allgather_base_`. Op-level SAC must not keep
    that output (the gathered experts would stay alive until backward)."""
    op = dist_runs["ep2_fsdp2_op"]
    gathered = op["expert_gather_numels"]
    assert len(gathered) == 2 and min(gathered) == 4 * 3 * 64 * 32  # 4 local experts x (w1, w2, w3)
    print("largest SAC-cached tensor", max(op["kept_numels"]), "gathered experts", gathered,
          "SAC cache bytes", op["sac_cache"])
    assert max(op["kept_numels"]) < min(gathered)
    assert not any("SAVE c10d." in line for line in op["trace"])  # (runtime ops bypass the policy)
    # DeepSeek's MoE rules under EP: the experts' down GEMM and its un-regrouping are not
    # recomputed (the kept combine all-to-all is all that reads them); numerics below.
    for op_name in ("aten._grouped_mm.default", "aten.index_select.default"):
        assert any(line.startswith(f"AC_TRACE SKIP {op_name}") for line in op["trace"]), op_name
    _assert_same_run(op, dist_runs["ep2_fsdp2_none"])


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.timeout(450)
def test_op_under_sequence_parallel_recomputes_all_gathers(dist_runs):
    """TP 2 with SP: by default op-level SAC does not keep the two full-sequence all-gather
    outputs of each block ([local batch, seq, dim] each); with save_all_gathers it does."""
    default, keep = dist_runs["tp2_sp_op"], dist_runs["tp2_sp_op_keep_all_gathers"]
    n_layers, dim = 3, 64
    print("SAC cache bytes: default", default["sac_cache"], "keeping all-gathers", keep["sac_cache"])
    assert keep["sac_cache"] - default["sac_cache"] == 2 * n_layers * LOCAL_BATCH * SEQ * dim * 4
    assert "AC_TRACE RECOMPUTE _c10d_functional.all_gather_into_tensor.default" in default["trace"]
    assert "AC_TRACE SAVE _c10d_functional.all_gather_into_tensor.default" in keep["trace"]
    assert "AC_TRACE SAVE _c10d_functional.reduce_scatter_tensor.default" in default["trace"]
    _assert_same_run(default, dist_runs["tp2_sp_none"])
    _assert_same_run(keep, dist_runs["tp2_sp_none"])
