"""float8.moe_grouped_gemm stores the routed experts in the layout torchao's float8 grouped
GEMM reads (`GroupedExperts.store_for_kernel`: [E, N, K], each expert's matrix column-major
as [E, K, N]), so the kernel gets views instead of a copy of every expert weight per call.
The kernel is CUDA SM90+ only: here it is replaced by `torch._grouped_mm` on the same
arguments, which shows what it receives. The state dict (checkpoints, HF export) keeps the
[E, K, N] layout, init draws the same values, and the math is the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import get_model_spec
from models.common.moe import GroupedExperts


def _deepseek(kernel_layout: bool, device: str = "cpu"):
    from parallelisms.float8 import enable_float8_grouped_experts

    spec = get_model_spec("deepseek_v3")
    args = dataclasses.replace(spec.flavors["debug"], n_layers=2)
    with torch.device("meta"):
        model = spec.model_cls(args)
    if kernel_layout:
        assert enable_float8_grouped_experts(model, None)  # what apply_float8 runs (its device check aside)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    return model


def test_state_dict_and_init_keep_the_external_layout():
    plain, kernel = _deepseek(False), _deepseek(True)
    experts = [m for m in kernel.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(m.kernel_layout and m.float8_grouped_mm for m in experts)
    e = experts[0]
    n, dim, hidden = e.w1.shape[0], e.w2.shape[1], e.w1.shape[1]
    assert e.w1.shape == (n, hidden, dim) and e.weights()[0].shape == (n, dim, hidden)  # stored [E, N, K]
    assert e.weights()[0].stride(-2) == 1  # the view is column-major per expert
    sd_plain, sd_kernel = plain.state_dict(), kernel.state_dict()
    assert sd_plain.keys() == sd_kernel.keys()
    for k in sd_plain:  # the same values in the same (external) layout: init and state dict
        assert sd_plain[k].shape == sd_kernel[k].shape and torch.equal(sd_plain[k], sd_kernel[k]), k
    # Loading an external-layout state dict (a checkpoint, an HF import) into either layout.
    other = _deepseek(True)
    for p in other.parameters():
        p.data.zero_()
    other.load_state_dict(sd_plain)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), sd_plain.values()))
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    got = get_model_state_dict(kernel)
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in sd_plain.items()}


def test_dcp_round_trip_between_layouts(tmp_path):
    import torch.distributed.checkpoint as dcp

    kernel = _deepseek(True)
    dcp.save(kernel.state_dict(), checkpoint_id=str(tmp_path / "ck"))
    plain = _deepseek(False)
    for p in plain.parameters():
        p.data.zero_()
    target = plain.state_dict()
    dcp.load(target, checkpoint_id=str(tmp_path / "ck"))
    plain.load_state_dict(target)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), kernel.state_dict().values()))


@pytest.fixture
def fake_float8_kernel(monkeypatch):
    """torchao's float8 grouped GEMM replaced by the bf16/fp32 one on the same arguments;
    records the weights it is handed."""
    import torchao.prototype.moe_training as moe_training

    seen = []

    def kernel(x, w, offs, out_dtype=None, pad_token_groups_for_grouped_mm=False):
        seen.append(w)
        return torch._grouped_mm(x, w, offs=offs)

    monkeypatch.setattr(moe_training, "_to_fp8_rowwise_then_scaled_grouped_mm", kernel)
    return seen


def _experts(kernel_layout: bool) -> GroupedExperts:
    torch.manual_seed(0)
    m = GroupedExperts(dim=16, hidden_dim=32, num_experts=4)
    m.float8_grouped_mm = True
    if kernel_layout:
        m.store_for_kernel()
    torch.manual_seed(1)
    m.init_weights(0.02, 0.02)
    return m


def test_the_kernel_gets_views_of_the_stored_weights_and_the_same_numbers(fake_float8_kernel):
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(2))
    out, grads = {}, {}
    for layout in (False, True):
        m = _experts(layout)
        fake_float8_kernel.clear()
        xi = x.clone().requires_grad_()
        y = m(xi, counts)
        y.square().sum().backward()
        out[layout] = y.detach()
        grads[layout] = [xi.grad] + [g.mT if layout else g for g in (m.w1.grad, m.w2.grad, m.w3.grad)]
        params = {m.w1.data_ptr(), m.w2.data_ptr(), m.w3.data_ptr()}
        handed = {w.data_ptr() for w in fake_float8_kernel}
        assert len(fake_float8_kernel) == 3 and all(w.stride(-2) == 1 for w in fake_float8_kernel)
        if layout:
            assert handed == params  # views of the parameters: nothing copied
        else:
            assert not handed & params  # the row-major layout is copied on every call
    assert torch.equal(out[False], out[True])
    for a, b in zip(grads[False], grads[True]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()


def test_stored_layout_under_ep_and_fsdp_equals_the_plain_one():
    """tests/expert_layout_worker.py: EP then FSDP2 (one rank each) over the stored layout:
    the same loss, state dict and grads as the plain layout, bitwise."""
    import json
    import os
    import sys

    from tests.helpers import REPO, run_killing_group

    proc = run_killing_group([sys.executable, "-m", "tests.expert_layout_worker"], cwd=REPO,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["experts"] >= 3 and got["state_equal"], got
    assert got["loss_kernel"] == got["loss_plain"] and got["max_grad_rel"] == 0.0, got
