"""The guards of the fast AC paths (replayed forward, direct recompute): what a later call must share with the recorded one.

From a block's third call, `op`, `budget`, `full` and `selective` cut kept outputs from the
packs by their recorded views (parallelisms/ac_replay.py) and rebuild the dropped packs by
replaying the recorded aten ops on the recorded storages (parallelisms/ac_direct.py). That
holds only for a call that packs what the recorded call packed, laid out the same way, from
the same numbers. Each test below changes one thing in a later call that shape, dtype and the
packing op alone do not see (a Python number of the block, a transposed input, an input at
another storage offset, two inputs that no longer share a storage, a number read from data)
and checks every mode against `none`, bitwise, loss, parameter and input gradients, on the
calls before the change (fast path) and after it (the call falls back, exactly).

And a no-grad forward (validation), which torch's checkpoint runs without entering the AC
contexts, must leave no pack listener behind: one left there held every later pack of every
block that ran through torch's checkpoint, a leak that grew every step.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelisms import ac_dce
from parallelisms.activation_checkpoint import ActivationCheckpointConfig, apply_activation_checkpointing
from tests.ac_helpers import clean_name, tiny_deepseek, token_batches

D = 16
MODES = ("op", "budget", "full", "selective")
CHANGE_AT = 3  # calls 1 and 2 record and plan; call 3 is the first fast one; the change comes at call 4
STEPS = 5


class _Block(nn.Module):
    """Dropped packs rebuilt through a scalar multiply (`scale`), a view of `w`, and inputs that
    may share a storage. With `read_item`, a number read from data (`.item()`) scales `h`."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.scale = 0.5
        self.read_item = False

    def forward(self, x, y, w):
        x, y, w = x.float(), y.float(), w.float()  # (bf16 inputs: then only these casts read them)
        h = self.a(x) * torch.sigmoid(self.b(y))
        if self.read_item:
            h = h / (1.0 + y.detach().abs().amax().item())
        g = torch.tanh(h * self.scale)
        t = torch.tanh(w[..., : D // 2])
        return x * w + self.c(g * g) + torch.cat([t, t], -1)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Block(), "1": _Block()})

    def forward(self, x, y, w):
        for layer in self.layers.values():
            x = layer(x, y, w)
        return x


def _inputs(case: str, step: int, dtype=torch.float32):
    """(x, y, w) of one step; from step CHANGE_AT, the case's change (`scalar` and `item`
    change the block, not the inputs). Leaves that require grad, or views of them. In bf16
    nothing packs them (the block's casts do not): the direct steps read the arguments."""
    g = torch.Generator().manual_seed(step)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)

    z = randn(4, 4, 2 * D)
    x, y = z[..., :D], z[..., D:]  # one storage, offsets 0 and D
    w = randn(4, 4, D).detach()
    if step >= CHANGE_AT:
        if case == "stride":  # a leaf of the same shape with its first two strides swapped
            w = w.transpose(0, 1)
        elif case == "offset":  # the same views, 2 * D * 4 elements further into their storage
            big = randn(5, 4, 2 * D)
            x, y = big[1:, :, :D], big[1:, :, D:]
        elif case == "alias":  # the same views, of two storages
            z1, z2 = randn(4, 4, 2 * D), randn(4, 4, 2 * D)
            x, y = z1[..., :D], z2[..., D:]
    return x, y, w.requires_grad_(True)


def _run(mode: str, case: str, dtype=torch.float32) -> tuple[list, object, list]:
    """Per step: (loss, every parameter and input gradient); the policy; per step, whether the
    blocks had a direct recompute or replay going into it."""
    torch.manual_seed(0)
    model = _Model()
    if case == "item":
        for block in model.layers.values():
            block.read_item = True
    policy = apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=mode))
    record, fast = [], []
    for step in range(STEPS):
        if case == "scalar":
            for block in model.layers.values():
                getattr(block, "_checkpoint_wrapped_module", block).scale = 0.5 if step < CHANGE_AT else 0.9
        inputs = _inputs(case, step, dtype)
        for t in inputs:
            t.retain_grad()
        plans = getattr(policy, "plans", None) or {}
        fast.append(any(p.replay is not None or p.direct is not None for p in plans.values()))
        model.zero_grad(set_to_none=True)
        loss = (model(*inputs).float() ** 2).mean()
        loss.backward()
        grads = {clean_name(n): p.grad.clone() for n, p in model.named_parameters()}
        grads.update({f"input{i}": t.grad.clone() for i, t in enumerate(inputs)})
        record.append((loss.detach(), grads))
    return record, policy, fast


def _diverging_steps(ref: list, got: list) -> list[int]:
    return [step for step, ((l_ref, g_ref), (l_got, g_got)) in enumerate(zip(ref, got))
            if not (torch.equal(l_ref, l_got) and g_ref.keys() == g_got.keys()
                    and all(torch.equal(g_ref[k], g_got[k]) for k in g_ref))]


@pytest.mark.parametrize("case", ["scalar", "stride", "offset", "alias", "item", "stride_bf16", "offset_bf16",
                                  "alias_bf16"])
def test_a_later_call_that_differs_from_the_recorded_one_is_exact(case):
    """Before the checks, `scalar`, `offset` and `alias` gave wrong gradients from the changed
    call on in every mode, `stride` in all but `budget` (which keeps the rebuilt pack): the
    direct steps replayed the recorded number and read the recorded views. With bf16 inputs
    (`_bf16`) no pack holds them and the steps read the block's arguments: the same changes
    must be caught on the arguments (`ac_direct._DirectCall.take_args`)."""
    case, dtype = case.removesuffix("_bf16"), torch.bfloat16 if case.endswith("_bf16") else torch.float32
    ref, _, _ = _run("none", case, dtype)
    for mode in MODES:
        got, policy, fast = _run(mode, case, dtype)
        assert _diverging_steps(ref, got) == [], f"{mode}: {case} changed at step {CHANGE_AT}"
        if case != "item":  # the fast path ran before the change (so the check is what kept it exact)
            assert fast[CHANGE_AT] and policy.plans, (mode, fast)  # (selective: block 0 only)


@pytest.mark.parametrize("mode", ["budget", "full", "selective"])
def test_a_number_read_from_data_gets_no_direct_recompute(mode):
    """`.item()` in a block: the direct steps would replay the recorded number, so no block
    gets one (a replay may run: its recompute re-runs the block's code, and a kept `.item()`
    would make none). Before, `budget` ran the steps (wrong gradients from the first call with
    other data), and `full` had built them, unused. (`op` keeps the `amax` before the
    `.item()`, which no pack holds: it never had a replay here.)"""
    _, policy, _ = _run(mode, "item")
    assert policy.plans and all(p.direct is None for p in policy.plans.values())


def test_pack_meta_tells_views_offsets_and_aliases_apart():
    base = torch.randn(4, 4, 8)
    other = torch.randn(4, 4, 8)
    one = ac_dce.pack_metas([base[..., :4], base[..., 4:]])
    assert one[1][3:] == ((32, 8, 1), 4, 0)  # strides, offset, aliases pack 0
    assert ac_dce.pack_metas([base[..., :4], other[..., 4:]])[1][3:] == ((32, 8, 1), 4, 1)  # its own storage
    assert ac_dce.pack_metas([base.transpose(0, 1)])[0][3] == (8, 32, 1)
    assert ac_dce.pack_metas([base[1:]])[0][4] == 32


# ---------------------------------------------------------------------------
# No-grad forwards (validation)
# ---------------------------------------------------------------------------

def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector can see."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor:
            s = obj.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("mode", ["op", "budget", "full"])
def test_validation_forwards_leave_no_pack_listener_and_pin_nothing(mode):
    """Tiny DeepSeek (its MoE block runs through torch's checkpoint, whose pack probe feeds the
    listeners), a no-grad forward before every step: no listener is left after either, the
    memory held after a step stops growing, and the gradients equal `none`'s bitwise. Before
    the fix each no-grad forward of a recording block left its listeners in
    `PACK_LISTENERS`, holding every later pack: 0.5 to 0.9 MiB more per step."""
    batches = token_batches(7, vocab=256)
    ref, held, before = [], [], list(ac_dce.PACK_LISTENERS)
    for run in ("none", mode):
        model = tiny_deepseek()
        apply_activation_checkpointing(model, ActivationCheckpointConfig(mode=run))
        for step, (tokens, target) in enumerate(batches):
            with torch.no_grad():
                model(tokens)  # validation
            assert ac_dce.PACK_LISTENERS == before, (run, step)
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(tokens).flatten(0, -2), target.flatten())
            loss.backward()
            assert ac_dce.PACK_LISTENERS == before, (run, step)
            got = (loss.detach(), {clean_name(n): p.grad.clone() for n, p in model.named_parameters()})
            if run == "none":
                ref.append(got)
                continue
            assert _diverging_steps(ref[step:step + 1], [got]) == [], step
            del loss, got
            held.append(_live_tensor_bytes())
    assert held[-1] <= held[2], [f"{b / 2**20:.2f} MiB" for b in held]
