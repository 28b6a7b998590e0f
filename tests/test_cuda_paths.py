"""CUDA-only code paths, checked on CPU where the decision is made in Python: NCCL's eager
start-up with device_id, and gloo beside it under fsdp_cpu_offload; the host reads of an EP MoE step (which sync a GPU); async checkpoint
staging into cached host buffers; compiled CP attention without a mask."""

from __future__ import annotations

import json
import os
import sys

import torch

from tests.helpers import REPO, free_port, run_killing_group
from trainer import distributed


def test_nccl_starts_eagerly_with_device_id(monkeypatch):
    calls = []
    monkeypatch.setattr(distributed, "_timeout_s", None)  # init_distributed sets it
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    cuda = torch.device("cuda", 1)
    assert distributed.init_distributed(cuda, 30) == "nccl"
    assert calls[0] == ("set_device", cuda)
    assert calls[1][1]["backend"] == "nccl" and calls[1][1]["device_id"] == cuda  # NCCL bound and started now
    calls.clear()
    assert distributed.init_distributed(torch.device("cpu"), 30) == "gloo"
    assert calls == [("init", {"backend": "gloo", "timeout": calls[0][1]["timeout"]})]  # gloo: no device_id
    calls.clear()
    # fsdp_cpu_offload: sharded state on the host, so every group carries gloo for CPU tensors
    # (clipping's norm, Muon's assembly); NCCL alone would refuse them at the first collective.
    assert distributed.init_distributed(cuda, 30, cpu_collectives=True) == "cuda:nccl,cpu:gloo"
    assert calls[1][1]["backend"] == "cuda:nccl,cpu:gloo" and calls[1][1]["device_id"] == cuda


def test_expert_parallel_reads_the_host_once_per_moe_layer_and_never_in_the_recompute():
    """tests/sync_worker.py: the real EP dispatcher on a one-rank gloo mesh, op AC. The forward
    reads the split sizes once per MoE layer (`.tolist()`); nothing else syncs (before:
    repeat_interleave without output_size, once per layer in the forward and again in the
    recompute). The recompute's `.tolist()` calls are CPU-only: on CUDA the op policy saves
    their device-to-host copy (`is_device_to_host`), so they read nothing."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = run_killing_group([sys.executable, "-m", "tests.sync_worker", str(free_port())], cwd=REPO, env=env,
                             timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reads = json.loads(proc.stdout.strip().splitlines()[-1])
    assert reads["moe_layers"] == 2
    assert reads["forward"] == {"tolist": 2}, reads
    assert set(reads["backward"]) <= {"tolist"}, reads  # no hidden sync in the recompute or the backward


def test_expert_parallel_compiled_under_op_ac_in_a_fresh_process_equals_eager():
    """EP + compile + op AC, as a fresh process meets it (the first call of every compiled
    piece is the forward's; the recompute is the second). The combine's all-to-all output
    used to reach the compiled resume of `MoE.forward` as an AsyncCollectiveTensor, waited out
    of the SAC modes' sight while compiling and in sight in the recompute: "wait_tensor
    invocation index 1 ... not found in storage" at the first backward, on any EP degree.
    One step here equals eager without AC."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = run_killing_group([sys.executable, "-m", "tests.sync_worker", str(free_port()), "compile"], cwd=REPO,
                             env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["grads"] > 40
    assert abs(got["loss_compiled"] - got["loss_eager"]) <= 1e-5 * abs(got["loss_eager"]), got
    assert got["max_grad_rel"] <= 1e-5, got


def test_async_saves_stage_into_the_same_host_buffers_and_write_the_right_bytes(tmp_path):
    import torch.distributed.checkpoint as dcp

    from tests.helpers import TINY
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(TINY + ["--training.steps", "3", "--checkpoint.enable", "--checkpoint.interval", "1",
                                          "--checkpoint.async_mode", "async", "--job.dump_folder", str(tmp_path)]))
    ck, seen = trainer.checkpointer, {}
    original_save = ck.save

    def save(step, **kw):
        original_save(step, **kw)
        if ck._stager is not None and step not in seen:
            expected = {"model": {k: v.detach().clone() for k, v in ck._model_state().items()},
                        "optimizer": {k: v.detach().clone() for k, v in ck._optimizer_state().items()
                                      if isinstance(v, torch.Tensor)}}
            seen[step] = ({k: b.data_ptr() for k, b in ck._stager._buffers.items()}, ck._stager.allocations, expected)

    ck.save = save
    try:
        trainer.train()
    finally:
        trainer.close()
    (ptrs1, alloc1, _), (ptrs2, alloc2, expected2) = seen[1], seen[2]
    assert alloc1 == len(ptrs1) > 10 and alloc2 == alloc1  # the second save allocated nothing
    assert ptrs2 == ptrs1  # ... and staged into the first save's storages
    assert not any(b.is_pinned() for b in ck._stager._buffers.values())  # pinned only for copies from a GPU
    loaded = {part: {k: torch.zeros_like(v) for k, v in sd.items()} for part, sd in expected2.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "checkpoint" / "step-2"))
    for part, sd in expected2.items():  # step-2 bytes on disk: the state at step 2, not a later one
        assert sd.keys() == loaded[part].keys()
        assert all(torch.equal(sd[k], loaded[part][k]) for k in sd), part


def test_compiled_cp_attention_on_cuda_builds_no_mask_and_matches_eager(monkeypatch):
    """Under torch.compile, CP's prefix attention takes flex attention with a lower-right
    BlockMask on CUDA (decided by `flex_under_compile`, forced here: flex has no CPU backward,
    so forward only). No [q, k] mask is built, and the result equals eager SDPA with the mask;
    the BlockMask equals create_block_mask's, ragged tiles included."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask

    from parallelisms import context_parallel as cp

    built = []
    monkeypatch.setattr(cp, "flex_under_compile", lambda device: True)
    real_mask = cp.lower_right_mask
    monkeypatch.setattr(cp, "lower_right_mask", lambda *a: built.append(a) or real_mask(*a))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 128, 24, generator=g)
    k, v = torch.randn(2, 2, 384, 24, generator=g), torch.randn(2, 2, 384, 16, generator=g)  # GQA, MLA's Dv
    with torch.no_grad():
        out = torch.compile(cp.attend_prefix, backend="eager", fullgraph=True)(q, k, v, 0.3)
        visible = torch.ones(128, 384, dtype=torch.bool).tril(256)
        ref = F.scaled_dot_product_attention(q, k, F.pad(v, (0, 8)), attn_mask=visible, scale=0.3,
                                             enable_gqa=True)[..., :16]
    assert built == []  # never a mask
    assert out.shape == ref.shape and (out - ref).abs().max() <= 1e-5
    for q_len, k_len in ((128, 384), (100, 300), (256, 256)):
        new = cp.lower_right_block_mask(q_len, k_len, torch.device("cpu"))
        old = create_block_mask(lambda b, h, qi, ki: ki <= qi + (k_len - q_len), None, None, q_len, k_len,
                                device="cpu")
        assert torch.equal(new.to_dense(), old.to_dense()), (q_len, k_len)
        assert torch.equal(new.full_kv_num_blocks, old.full_kv_num_blocks), (q_len, k_len)
    monkeypatch.undo()
    assert cp.flex_under_compile(torch.device("cuda", 0)) and not cp.flex_under_compile(torch.device("cpu"))
