"""The FLOPs per token behind `mfu_pct` and `mfu_causal_pct`, audited against
torch.utils.flop_counter.FlopCounterMode on a real forward and backward.

What is compared: `spec.summary_fn(model, args, S)["flops_per_token"]` (what the trainer
hands MetricsLogger, the non-causal convention of `mfu_pct`) and that minus half of
`trainer.metrics.attention_flops_per_token` (the causal convention of `mfu_causal_pct`),
against the count of one forward + backward over B x S tokens, divided by B x S, within 2%.

How each op is counted (see tests/flops_worker.py):
- matmuls (every Linear, the experts, the head): FlopCounterMode's own formulas;
- attention: FlopCounterMode has no formula for the CPU SDPA kernel and would count 0, so
  `reference_sdpa` runs it as plain matmuls, which FlopCounterMode counts at full
  (non-causal) cost; the causal figure counts only the pairs the mask allows, from the
  mask itself. MLA's zero-padded v channels are dropped (hardware work, not model work);
- MoE experts: `use_grouped_mm=False`, the per-expert loop of plain matmuls, because
  FlopCounterMode's registry has no `_grouped_mm` formula (it would count the experts as 0).
  The loop runs exactly the routed rows, so the count is that of the activated experts.
What neither side counts: element-wise ops, norms, softmax, the embedding lookup, the loss.
What the formula counts and the count does not: 6 x the norm gains and the expert-bias
buffers (under 0.2% here). The head is counted by both (6 x V x D per token; it is about
5-10% of these shapes' totals, not dominant).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.flops_worker import count_step
from trainer.metrics import attention_flops_per_token

TOL = 0.02
B, S = 2, 128


def _measure(spec_name: str, args, *, mtp: bool = False, document_ids: torch.Tensor | None = None,
             v_head_dim: int | None = None) -> dict[str, float]:
    """(formula, measured) FLOPs per token in both conventions, and the attention ledger."""
    from models import get_model_spec
    from parallelisms.apply import build_model

    spec = get_model_spec(spec_name)
    formula = spec.summary_fn(build_model(spec, args), args, S)["flops_per_token"]
    attention = attention_flops_per_token(args, S)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (B, S))
    labels = torch.randint(0, args.vocab_size, (B, S))

    def step():
        kwargs = {"document_ids": document_ids} if document_ids is not None else {}
        if mtp:
            kwargs["mtp_labels"] = labels
        logits = model(tokens, **kwargs)
        targets = labels.repeat(logits.shape[0] // B, 1)  # the MTP depths' logits follow on the batch dim
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()

    counts = count_step(step, v_head_dim)
    tokens_n = B * S
    measured = counts["total"] / tokens_n
    measured_causal = (counts["total"] - counts["attention_full"] + counts["attention_causal"]) / tokens_n
    return {"formula": formula, "formula_causal": formula - attention / 2, "measured": measured,
            "measured_causal": measured_causal, "attention_formula": attention,
            "attention_measured": counts["attention_full"] / tokens_n,
            "attention_causal_measured": counts["attention_causal"] / tokens_n}


def _check(r: dict[str, float], label: str) -> None:
    rel = abs(r["formula"] - r["measured"]) / r["measured"]
    rel_causal = abs(r["formula_causal"] - r["measured_causal"]) / r["measured_causal"]
    print(f"\n{label}: formula {r['formula']:,.0f} vs counted {r['measured']:,.0f} FLOPs/token ({rel:.2%}); "
          f"causal {r['formula_causal']:,.0f} vs {r['measured_causal']:,.0f} ({rel_causal:.2%})")
    # The attention term alone is exact in the non-causal convention (full [S, S] per head).
    assert r["attention_measured"] == pytest.approx(r["attention_formula"], rel=1e-9)
    assert rel <= TOL and rel_causal <= TOL


def _llama_args():
    from models.llama3.args import Llama3Args

    # GQA (8 q heads, 2 KV heads); the head is 6 x 256 x 128 of ~5.3M FLOPs/token.
    return Llama3Args(dim=128, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=S)


def _deepseek_args(**kw):
    from models.deepseek_v3.args import DeepSeekV3Args

    # MLA with q/k head dim 48 != v 32 (V3's 192 / 128 ratio is 1.5 too), q LoRA, 2 dense blocks first,
    # 8 experts top 3 in 2 of 4 groups, 1 shared expert.
    return DeepSeekV3Args(vocab_size=256, dim=128, n_layers=4, n_dense_layers=2, inter_dim=384, max_seq_len=S,
                          moe_inter_dim=128, n_routed_experts=8, n_shared_experts=1, n_activated_experts=3,
                          n_expert_groups=4, n_limited_groups=2, n_heads=8, q_lora_rank=64, kv_lora_rank=32,
                          qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_factor=1.0,
                          use_grouped_mm=False, **kw)


def _qwen3_args(**kw):
    from models.qwen3.args import Qwen3Args

    # head_dim 32 != dim / n_heads, GQA, tied head (dense) or untied (MoE, one dense block first).
    return Qwen3Args(dim=128, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, vocab_size=256, ffn_hidden_dim=384,
                     max_seq_len=S, use_grouped_mm=False, **kw)


def test_llama_gqa_flops_per_token():
    _check(_measure("llama3", _llama_args()), "llama3 GQA")


@pytest.mark.parametrize("mtp_depth", [0, 1])
def test_deepseek_mla_moe_flops_per_token(mtp_depth):
    args = _deepseek_args(mtp_depth=mtp_depth)
    r = _measure("deepseek_v3", args, mtp=mtp_depth > 0, v_head_dim=args.v_head_dim)
    _check(r, f"deepseek_v3 MLA + MoE (2 dense blocks, top 3 of 8), MTP {mtp_depth}")


def test_deepseek_padded_v_is_not_model_work():
    """The fused kernels get v zero-padded to the q/k head dim (MLA): counting the padded
    matmul would credit the model with H x (Dqk - Dv) x S more FLOPs per layer and token than
    its math does; `reference_sdpa` drops the padding (after checking it is zeros)."""
    args = _deepseek_args()
    padded = _measure("deepseek_v3", args)  # no v_head_dim: the padded v as SDPA gets it
    exact = _measure("deepseek_v3", args, v_head_dim=args.v_head_dim)
    extra = 6 * args.n_layers * args.n_heads * (args.qk_head_dim - args.v_head_dim) * S
    assert padded["attention_measured"] - exact["attention_measured"] == pytest.approx(extra, rel=1e-9)


@pytest.mark.parametrize("moe", [False, True])
def test_qwen3_flops_per_token(moe):
    args = (_qwen3_args(n_routed_experts=8, n_activated_experts=2, moe_inter_dim=128, mlp_only_layers=[0])
            if moe else _qwen3_args(tie_embeddings=True))
    _check(_measure("qwen3", args), f"qwen3 {'MoE (top 2 of 8)' if moe else 'dense, tied head'}")


def test_document_masking_keeps_the_window_convention():
    """Document masking does not change either figure: both conventions are of the window
    (as TorchTitan's and Megatron's), while the kernel skips the pairs across documents.
    The count with the block-causal mask equals the unmasked one at full cost, and the
    pairs it allows are exactly sum_d d (d + 1) / 2 over the documents (fewer than the
    window's S (S + 1) / 2: docs/performance.md says by how much)."""
    lengths = [40, 24, 64]  # three documents in each window of 128
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).repeat(B, 1)  # [B, S]
    args = _llama_args()
    masked = _measure("llama3", args, document_ids=doc)
    plain = _measure("llama3", args)
    assert masked["measured"] == plain["measured"] and masked["formula"] == plain["formula"]
    per_pair = 6 * args.n_layers * args.n_heads * 2 * args.head_dim / S  # FLOPs per attended pair of a sequence, per token
    assert masked["attention_causal_measured"] == pytest.approx(per_pair * sum(n * (n + 1) // 2 for n in lengths),
                                                                rel=1e-9)
    assert plain["attention_causal_measured"] == pytest.approx(per_pair * S * (S + 1) // 2, rel=1e-9)
    _check(plain, "llama3 (document masking: same figures)")


# --------------------------------------------------------------------------- context parallel

# Llama debug_small (GQA 4 / 2 heads) at seq 128.
CP_BASE = ["--model.flavor", "debug_small", "--training.seq_len", "128", "--training.local_batch_size", "2",
           "--training.steps", "1", "--metrics.enable_tensorboard", "false"]


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_cp_and_tp_rank_flops_times_degree_equal_one_rank(tmp_path):
    """One 2-rank launch. Under CP 2 (both methods) each rank's counted FLOPs, times cp,
    equal one rank's count of the same step in the causal convention: the CP kernels
    attend exactly the causal pairs (allgather's lower-right prefixes, alltoall's causal
    heads), and the head-tail layout gives each rank the same work. Under TP 2 each rank's
    count on its local shards, times tp, equals one rank's (every matmul is sharded; the
    attention runs on the rank's heads). The per-token formula is the one-rank figure in
    every layout (it is computed on the unsharded meta model); MetricsLogger divides tokens/s
    by non_data_parallel_size (cp x tp x pp), so MFU per device is this share."""
    from tests.helpers import torchrun
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(CP_BASE + ["--job.dump_folder", str(tmp_path / "ref")]))
    try:
        batches = trainer.next_microbatches()
        ref = count_step(lambda: trainer.train_step(batches, with_metrics=False))
        ref_formula = trainer.flops_per_token
        half_attention = attention_flops_per_token(trainer.model_args, S) / 2
    finally:
        trainer.close()
    assert trainer.dims.non_data_parallel_size == 1
    layouts = {"cp2_allgather": ["--parallelism.context_parallel_degree", "2"],
               "cp2_alltoall": ["--parallelism.context_parallel_degree", "2",
                                "--parallelism.context_parallel_method", "alltoall"],
               "tp2": ["--parallelism.tensor_parallel_degree", "2"]}
    cases = [{"name": n, "local_shapes": n == "tp2", "args": CP_BASE + extra + ["--job.dump_folder", str(tmp_path / n)]}
             for n, extra in layouts.items()]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    torchrun(2, [str(tmp_path / "cases.json"), str(tmp_path / "out")], module="tests.flops_worker", timeout=600)
    ref_causal = ref["total"] - ref["attention_full"] + ref["attention_causal"]
    tokens = B * S
    rel = abs((ref_formula - half_attention) * tokens - ref_causal) / ref_causal
    assert rel <= TOL
    for name in layouts:
        ranks = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        causal = [r["total"] - r["attention_full"] + r["attention_causal"] for r in ranks]
        print(f"\n{name}: per rank {causal} causal FLOPs per step; one rank {ref_causal} (formula {rel:.2%} off)")
        assert causal[0] == causal[1] and 2 * causal[0] == ref_causal
        assert all(r["flops_per_token"] == ref_formula for r in ranks)
        # What mfu_causal_pct credits one device with for this step (MetricsLogger: this rank's
        # tokens / non_data_parallel_size) is what the rank counted.
        r = ranks[0]
        credited = (r["flops_per_token"] - half_attention) * r["tokens"] / r["non_data_parallel_size"]
        assert r["non_data_parallel_size"] == 2 and abs(credited - causal[0]) / causal[0] <= TOL
        if name == "tp2":  # the non-causal count splits too (CP's prefixes are not [S, S] calls)
            assert 2 * ranks[0]["total"] == ref["total"]
