"""The direct recompute (parallelisms/ac_direct.py) under bf16 parameters and under autocast.

Every GPU run computes in bf16: FSDP2's mixed precision (bf16 params) on several GPUs,
autocast on one. The direct recompute was refused in both, so `op` and `full` blocks ran
torch's checkpoint recompute: with bf16 params the residual stream entering a block is
bf16, and only RMSNorm's `x.float()` and the residual add read it (neither packs it); under
autocast it was refused outright. Here, one process, bf16 params stand in for FSDP2's (the
2-rank FSDP2 run is in test_ac_multirank): from step 3 each block rebuilds directly, torch's
checkpoint re-runs none, the tensors a block holds after its forward are what
`saved_activation_bytes` counts for its mode, and every step equals `none` bitwise under
the same precision.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

from parallelisms.activation_checkpoint import ActivationCheckpointConfig, apply_activation_checkpointing
from tests.ac_helpers import block_inputs, clean_name, count_direct_paths, seeded_llama, token_batches


@pytest.fixture
def paths(monkeypatch):
    """(Counter of direct rebuilds and torch's re-runs of a block, the tensors each direct call
    holds after its forward): `ac_helpers.count_direct_paths`."""
    held: list = []
    return count_direct_paths(monkeypatch.setattr, held), held


def _held_bytes(tensors, outside) -> int:
    skip = {t.untyped_storage().data_ptr() for t in outside}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in storages.items() if ptr not in skip)


def _run(model, batches, setting: str, paths=None) -> list:
    """(loss, grads, (rebuilds, reruns), held tensors per direct call) per step."""
    out = []
    for tokens, target in batches:
        if paths is not None:
            paths[0].clear()
            paths[1].clear()
        model.zero_grad(set_to_none=True)
        region = torch.autocast("cpu", dtype=torch.bfloat16) if setting != "bf16_params" else contextlib.nullcontext()
        with region:
            loss = F.cross_entropy(model(tokens).flatten(0, -2).float(), target.flatten())
            if setting != "autocast_backward_outside":
                loss.backward()
        if setting == "autocast_backward_outside":
            loss.backward()
        counts = (paths[0]["rebuilds"], paths[0]["reruns"]) if paths is not None else None
        out.append((loss.detach(), {clean_name(n): p.grad.clone() for n, p in model.named_parameters()}, counts,
                    list(paths[1]) if paths is not None else None))
    return out


@pytest.mark.parametrize("mode", ["op", "full"])
@pytest.mark.parametrize("setting", ["bf16_params", "autocast", "autocast_backward_outside"])
def test_direct_recompute_runs_under_bf16_and_autocast_bitwise(paths, mode, setting):
    """`bf16_params`: the model in bf16 (what FSDP2's mixed precision computes in).
    `autocast`: fp32 params, forward and backward in one bf16 autocast region (the trainer on
    one GPU). `autocast_backward_outside`: backward after the region ends (torch's documented
    loop): step 3 is exact on the direct path, whose held weight casts would outlive autocast's
    cache, so from step 4 the blocks leave it (op: its dispatch-mode path; full: torch's
    checkpoint)."""
    from parallelisms.ac_measure import saved_activation_bytes
    base = seeded_llama("debug_small")
    if setting == "bf16_params":
        base = base.to(torch.bfloat16)
    batches = token_batches(4)
    ref = _run(copy.deepcopy(base), batches, setting)
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=mode))
    got = _run(model, batches, setting, paths)
    for step, ((l_ref, g_ref, _, _), (l_got, g_got, _, _)) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(l_ref, l_got), step
        assert g_ref.keys() == g_got.keys() and all(torch.equal(g_ref[n], g_got[n]) for n in g_ref), step
    blocks = len(model.layers)
    fourth = (0, blocks) if setting == "autocast_backward_outside" else (blocks, 0)
    assert [counts for _, _, counts, _ in got] == [(0, blocks), (0, blocks), (blocks, 0), fourth]
    # What a block holds after its forward on the direct path (step 3) is what its mode claims;
    # under autocast, also its weights' bf16 casts (autocast's cache holds them for the region).
    x, rope = block_inputs(base, batch=2, seq=16)
    x = x.detach().to(next(base.parameters()).dtype).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting != "bf16_params"):
        claim = saved_activation_bytes(copy.deepcopy(base.layers["0"]), x, rope, mode=mode)
    casts = 0 if setting == "bf16_params" else \
        sum(p.numel() * 2 for p in base.layers["0"].parameters() if p.dim() == 2)
    held = got[2][3]
    outside = [*model.parameters(), *model.buffers()]
    assert len(held) == blocks and all(_held_bytes(h, outside) == claim + casts for h in held)


def test_a_bf16_leaf_input_is_cast_like_any_tensor(paths):
    """A pipeline stage's first block receives a leaf that requires grad. Its `.float()`
    (RMSNorm, bf16 params) was taken for a parameter cast (`ac_modes.is_param_cast`, for
    autocast's cached weight casts), bypassed the SAC cache and went unrecorded: the direct
    recompute then held the fp32 copy as a tensor from outside the block (8 KiB here, a
    [tokens, dim] fp32 per stage), beyond what `op` counts, and `saved_activation_bytes` with a
    leaf input undercounted `budget` by the same copy. Autocast only caches fp32 sources."""
    from parallelisms.ac_measure import saved_activation_bytes
    base = seeded_llama("debug_small").to(torch.bfloat16)
    x, rope = block_inputs(base, batch=2, seq=16)
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="op"))
    block, plain = model.layers["0"], base.layers["0"]
    for call in range(3):
        got = []
        for blk in (plain, block):
            blk.zero_grad(set_to_none=True)
            leaf = x.detach().to(torch.bfloat16).requires_grad_(True)
            (blk(leaf, rope).float() * torch.linspace(-1, 1, x.shape[-1])).sum().backward()
            got.append([leaf.grad] + [p.grad for p in blk.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*got, strict=True)), call
    assert paths[0]["rebuilds"] == 1 and len(paths[1]) == 1  # (call 3: the direct path)
    leaf = x.detach().to(torch.bfloat16).requires_grad_(True)
    claims = {m: saved_activation_bytes(copy.deepcopy(plain), leaf, rope, mode=m) for m in ("op", "budget")}
    assert _held_bytes(paths[1][0], [*model.parameters(), *model.buffers(), rope]) == claims["op"]
    assert claims["budget"] == saved_activation_bytes(copy.deepcopy(plain), leaf * 1, rope, mode="budget")
