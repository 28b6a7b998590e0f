"""DeepSeek's MoE op policy under EP skips what only the kept combine reads, following the data.

On CUDA the experts pad every group (`padded_group_layout`), so the first index_select after
the last grouped GEMM is the GEMM's own un-pad, not the un-regroup before the combine; both
feed only the combine all-to-all (kept). The padded path is forced here on CPU, under a
one-rank EP mesh (gloo, in this process), and the test checks which outputs the SAC cache
keeps, which ops the recompute runs, and that gradients match `none` bitwise.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

aten = torch.ops.aten


def _tiny_moe():
    from tests.ac_helpers import tiny_deepseek  # one tiny DeepSeek for the AC tests
    return tiny_deepseek()


@pytest.fixture(scope="module")
def one_rank_ep():
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _storage(t) -> int:
    from parallelisms.ac_sac import plain_tensors
    return next(plain_tensors(t)).untyped_storage().data_ptr()  # (an AsyncCollectiveTensor: its tensor)


class _Recorder:
    """Wraps the MoE rules' decide to record (op, index, verdict, input storage, output
    storage) for every op of the MoE block's forward, and counts the recompute's ops."""

    def __init__(self, rules):
        self.rules, self.rows, self.recomputed = rules, [], []
        real = rules.decide

        def decide(call, func, is_recompute, args=(), out=None):
            verdict = real(call, func, is_recompute, args, out)
            if call.info.get("moe") and func is aten.index_select.default:
                self.rows.append((call.index, verdict[1], _storage(args[0]), _storage(out)))
            elif call.info.get("moe") and func is aten._grouped_mm.default:
                self.rows.append((call.index, verdict[1], None, _storage(out)))
            return verdict

        rules.decide = decide


def _step(model, tokens):
    loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                           for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("align", [8, 0], ids=["cuda_order_padded", "cpu_order"])
def test_moe_skip_follows_the_data(one_rank_ep, monkeypatch, align):
    import models.common.moe as moe_mod
    from models.deepseek_v3 import spec
    from parallelisms.activation_checkpoint import ActivationCheckpointConfig, apply_activation_checkpointing
    from parallelisms.expert_parallel import apply_expert_parallel

    # The CUDA kernels' group alignment, on CPU (its grouped GEMM takes any group sizes).
    monkeypatch.setattr(moe_mod, "grouped_mm_alignment", lambda x, float8=False: align)
    models = []
    for _ in range(2):  # the same seeded weights (a mesh cannot be deep-copied)
        models.append(_tiny_moe())
        assert apply_expert_parallel(models[-1], one_rank_ep) == 1
    base, model = models
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    ref = _step(base, tokens)

    policy = apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="op"), spec=spec)
    rec = _Recorder(policy)
    from parallelisms import ac_sac
    cached: list[dict] = []  # per MoE block call: {(op, index): what the SAC cache holds}
    real_finish = ac_sac.OpSACPolicy.finish

    def finish(call, storage, *counts):
        real_finish(call, storage, *counts)
        if call.info.get("moe"):
            cached.append({(op, i): "placeholder" if isinstance(e, ac_sac.Placeholder) else
                           "recompute" if e is torch.utils.checkpoint._RECOMPUTE else "tensor"
                           for op, entries in storage.items() for i, e in entries.items()})

    monkeypatch.setattr(ac_sac.OpSACPolicy, "finish", finish)
    got = _step(model, tokens)

    # Values: bitwise equal to none whatever is skipped.
    assert torch.equal(ref[0], got[0])
    assert ref[1].keys() == got[1].keys()
    for name in ref[1]:
        assert torch.equal(ref[1][name], got[1][name]), name

    gemms = [r for r in rec.rows if r[2] is None]
    selects = [r for r in rec.rows if r[2] is not None]
    assert [v for _, v, _, _ in gemms] == ["SAVE", "RECOMPUTE", "SKIP"]
    down_out = gemms[-1][3]
    after = [r for r in selects if rec.rows.index(r) > rec.rows.index(gemms[-1])]
    before = [r for r in selects if rec.rows.index(r) < rec.rows.index(gemms[0])]
    # Before the GEMMs (the EP regroup, and on CUDA the pad): the default rules.
    assert before and all(v != "SKIP" for _, v, _, _ in before)
    n_skip = 2 if align else 1
    # Padded (CUDA order): the un-pad reads the down GEMM's output, the un-regroup reads the
    # un-pad's: both skipped. Unpadded: the un-regroup reads the GEMM's output. After the
    # combine, the MoE's own un-sort reads the combine's (kept) output: default rules.
    assert [v for _, v, _, _ in after] == ["SKIP"] * n_skip + ["RECOMPUTE"] * (len(after) - n_skip)
    assert len(after) > n_skip
    assert after[0][2] == down_out and (not align or after[1][2] == after[0][3])
    skipped = after[:n_skip]
    # What the cache holds: the gate GEMM's output, the combine all-to-all; placeholders
    # (the recompute does not run them) for the down GEMM and every skipped index_select.
    (held,) = cached
    g = aten._grouped_mm.default
    assert [held[(g, i)] for i, _, _, _ in gemms] == ["tensor", "recompute", "placeholder"]
    assert [held[(aten.index_select.default, i)] for i, _, _, _ in skipped] == ["placeholder"] * n_skip
    assert all(held[(aten.index_select.default, i)] == "recompute" for i, _, _, _ in before)
    a2a = torch.ops._c10d_functional.all_to_all_single.default
    assert [k for k in held if k[0] is a2a] and all(held[k] == "tensor" for k in held if k[0] is a2a)
