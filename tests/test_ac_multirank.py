"""Every AC mode under 2-rank FSDP2 (gloo, CPU) matches a 1-process run within 1e-5.

One spawn runs all the modes (each process pays ~5 s to import torch), a dense Llama
and a MoE DeepSeek, for 2 optimizer steps each. Rank 0 writes the losses and the full
(unsharded) gradients; the test compares them with an unsharded, un-checkpointed run.
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
STEPS = 2
CASES = [("llama3", "none"), ("llama3", "full"), ("llama3", "selective"), ("llama3", "op"),
         ("deepseek_v3", "full"), ("deepseek_v3", "op")]


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


def _train(model, batches, rows=slice(None)):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for tokens, labels in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tokens[rows]).flatten(0, 1), labels[rows].flatten())
        loss.backward()
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
    from torch.distributed.fsdp import fully_shard

    from parallelisms.activation_checkpoint import ActivationCheckpointConfig, apply_activation_checkpointing

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        batches = _batches()
        results = {}
        for name, mode in CASES:
            model, spec = _build(name)
            apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=mode), spec=spec)
            for block in model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            run = _train(model, batches, rows=slice(2 * rank, 2 * rank + 2))
            # Each rank's loss is its local mean; the global mean is their average.
            for loss, _ in run:
                dist.all_reduce(loss)
                loss /= WORLD
            results[(name, mode)] = run
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_every_mode_under_fsdp2_matches_one_process(tmp_path):
    out_path = str(tmp_path / "ranks.pt")
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
    got = torch.load(out_path)

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
