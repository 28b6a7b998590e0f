"""FLOP counting for tests/test_flops.py: a reference attention FlopCounterMode can count,
and the CP worker (one torchrun launch, every CP case).

Why a reference attention: FlopCounterMode's registry has no formula for the kernel SDPA
picks on CPU (`_scaled_dot_product_flash_attention_for_cpu`), so it would count attention
as 0; and where it has one (the CUDA kernels) it counts the call's full [Sq, Sk] cost
whatever the mask, and MLA's v zero-padded to the q/k head dim (models/common/attention.py
pads it for the fused kernels). `reference_sdpa` replaces F.scaled_dot_product_attention
with plain matmuls, so FlopCounterMode counts the attention at full (non-causal) cost over
the *model's* head dims (the padding is dropped again, after checking it is zeros), and it
records the (query, key) pairs the mask allows, from which the causal work is exact.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.flops_worker CASES.json OUT_DIR
"""

from __future__ import annotations

import json
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class AttentionLedger:
    """What the reference attention did: `full` FLOPs (forward + backward, every (q, k)
    pair of each call, as FlopCounterMode counts its matmuls) and `causal` FLOPs (only
    the pairs the call's mask allows), both over the model's head dims."""

    def __init__(self, v_head_dim: int | None = None):
        self.v_head_dim = v_head_dim  # the model's Dv when SDPA pads v (MLA); None = v as given
        self.full = 0
        self.causal = 0
        self.calls = 0


_LEDGER: AttentionLedger | None = None


def _allowed(attn_mask, is_causal: bool, sq: int, sk: int, device) -> torch.Tensor:
    """[.., Sq, Sk] bool: the pairs a call attends."""
    if attn_mask is None:
        full = torch.ones(sq, sk, dtype=torch.bool, device=device)
        return full.tril() if is_causal else full  # SDPA's is_causal is aligned to the top left
    if attn_mask.dtype == torch.bool:
        return attn_mask
    return torch.isfinite(attn_mask)  # additive mask: -inf = not attended


def reference_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as plain matmuls. q [B, Hq, Sq, Dqk], k [B, Hkv, Sk,
    Dqk], v [B, Hkv, Sk, Dv'] -> [B, Hq, Sq, Dv']."""
    assert dropout_p == 0.0 and _LEDGER is not None
    dv_in = v.shape[-1]
    dv = _LEDGER.v_head_dim or dv_in
    if dv < dv_in:  # SDPA padded MLA's v with zeros for the fused kernels: not model work
        assert torch.count_nonzero(v[..., dv:]) == 0
        v = v[..., :dv]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # GQA: [B, Hq, Sk, D]
    b, hq, sq, dqk = q.shape
    sk = k.shape[2]
    allowed = _allowed(attn_mask, is_causal, sq, sk, q.device)
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(dqk))  # [B, Hq, Sq, Sk]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    out = probs @ v  # [B, Hq, Sq, Dv]
    # Forward: 2 * pairs * Dqk (scores) + 2 * pairs * Dv (values); backward twice that.
    per_pair = 6 * (dqk + dv)
    _LEDGER.full += per_pair * b * hq * sq * sk
    _LEDGER.causal += per_pair * hq * int(allowed.expand(b, 1, sq, sk).sum())
    _LEDGER.calls += 1
    return F.pad(out, (0, dv_in - dv)) if dv < dv_in else out


@contextmanager
def counted_attention(v_head_dim: int | None = None):
    """Every F.scaled_dot_product_attention call inside runs `reference_sdpa`; yields its ledger."""
    global _LEDGER
    original = F.scaled_dot_product_attention
    _LEDGER = AttentionLedger(v_head_dim)
    F.scaled_dot_product_attention = reference_sdpa
    try:
        yield _LEDGER
    finally:
        F.scaled_dot_product_attention = original
        _LEDGER = None


class LocalShapeFlopCounter:
    """FlopCounterMode's formulas (its registry, `parallelisms.ac_ops.op_flops`) applied to each
    rank's local shards. FlopCounterMode itself sees a DTensor op once, at the DTensor level,
    and counts its global shape: under TP every rank would be credited with the whole matmul."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        from parallelisms.ac_ops import op_flops

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter.total += op_flops(func, args, kwargs, out)
                return out

        self.total, self._mode = 0, Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)

    def get_total_flops(self) -> int:
        return self.total


def count_step(step_fn, v_head_dim: int | None = None, local_shapes: bool = False) -> dict[str, int]:
    """FLOPs of `step_fn()` (a forward and backward) as FlopCounterMode counts them (on local
    shards with `local_shapes`), with the attention through `reference_sdpa`:
    {"total", "attention_full", "attention_causal"}."""
    from torch.utils.flop_counter import FlopCounterMode

    counter_cls = LocalShapeFlopCounter if local_shapes else (lambda: FlopCounterMode(display=False))
    with counted_attention(v_head_dim) as ledger, counter_cls() as counter:
        step_fn()
    assert ledger.calls > 0
    return {"total": counter.get_total_flops(), "attention_full": ledger.full, "attention_causal": ledger.causal}


def run_case(case: dict, out: Path) -> None:
    """One training step of `case["args"]` with its FLOPs counted on every rank."""
    import torch.distributed as dist

    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(case["args"]))
    try:
        batches = trainer.next_microbatches()
        counts = count_step(lambda: trainer.train_step(batches, with_metrics=False),
                            local_shapes=case.get("local_shapes", False))
        counts["tokens"] = trainer.cfg.training.local_batch_size * trainer.cfg.training.seq_len
        counts["non_data_parallel_size"] = trainer.dims.non_data_parallel_size
        counts["flops_per_token"] = trainer.flops_per_token
    finally:
        trainer.close(destroy_process_group=False)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, counts)
    if dist.get_rank() == 0:
        (out / f"{case['name']}.json").write_text(json.dumps(gathered))


if __name__ == "__main__":
    from tests.helpers import run_worker_cases

    from trainer.distributed import exit_process
    exit_process(run_worker_cases(run_case, "FLOPS_ONLY"))
