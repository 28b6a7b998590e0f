"""DeepSeek V3 hyper-parameters, the published flavors, and parameter / FLOP counts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass
class DeepSeekV3Args:
    vocab_size: int = 129280
    dim: int = 7168
    n_layers: int = 61
    norm_eps: float = 1e-6
    max_seq_len: int = 16384
    # Dense FFN (the first `n_dense_layers` blocks) hidden width.
    inter_dim: int = 18432
    n_dense_layers: int = 3

    # --- MoE ---
    moe_inter_dim: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 8  # top-k
    n_expert_groups: int = 8  # 1 = no group-limited routing
    n_limited_groups: int = 4  # groups kept per token
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    route_scale: float = 2.5
    # Normalise the top-k weights to sum to 1 before `route_scale`. None = only for sigmoid.
    route_norm: bool | None = None
    # Sequence-level balance loss coefficient (DeepSeek V3's alpha); 0 disables it.
    aux_loss_coeff: float = 0.0
    # "sequence": the loss per sequence (DeepSeek V3); "batch": over all tokens of a forward; "model":
    # over every MoE layer of a forward too (MoEArgs).
    aux_loss_scope: Literal["sequence", "batch", "model"] = "sequence"
    # Aux-loss-free balancing: expert_bias += coeff * sign(mean load - load) after each
    # optimizer step (spec.post_optimizer_step_fn). 0 freezes the bias.
    load_balance_coeff: float = 1e-3
    # Routed experts through torch._grouped_mm where it applies, else a per-expert loop.
    use_grouped_mm: bool = True

    # --- MLA ---
    n_heads: int = 128
    q_lora_rank: int = 1536  # 0 = plain wq
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    # --- RoPE / YaRN ---
    rope_theta: float = 10000.0
    # YaRN is on when rope_factor > 1 (as in HF, independent of max_seq_len).
    rope_factor: float = 40.0
    original_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0

    # Init std of the weights that write into the residual stream is scaled by depth.
    depth_init: bool = True

    # Multi-token prediction (models/deepseek_v3/mtp.py): MTP modules after the main model,
    # module k predicting the token k + 1 positions ahead. 0 = none.
    mtp_depth: int = 0

    def __post_init__(self) -> None:
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be softmax or sigmoid, got {self.score_func!r}")
        if self.n_routed_experts % self.n_expert_groups:
            raise ValueError("n_expert_groups must divide n_routed_experts")
        if not 1 <= self.n_limited_groups <= self.n_expert_groups:
            raise ValueError("n_limited_groups must be in [1, n_expert_groups]")
        if self.n_activated_experts > self.n_limited_groups * (self.n_routed_experts // self.n_expert_groups):
            raise ValueError("n_activated_experts exceeds the experts in the kept groups")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even")
        if self.mtp_depth < 0:
            raise ValueError("mtp_depth must be >= 0")

    # ---- derived ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn_enabled(self) -> bool:
        return self.rope_factor > 1.0

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's attention-temperature correction mscale^2
        with mscale = 0.1 * self.mscale * ln(rope_factor) + 1."""
        scale = self.qk_head_dim**-0.5
        if self.yarn_enabled:
            m = 0.1 * self.mscale * math.log(self.rope_factor) + 1.0
            scale = scale * m * m
        return scale

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    # ---- counts (analytic; tests check them against a meta-device model) ----
    def _attention_params(self) -> int:
        h, d = self.n_heads, self.dim
        if self.q_lora_rank == 0:
            q = d * h * self.qk_head_dim
        else:
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        kv = (d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
              + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + h * self.v_head_dim * d

    def expert_params(self) -> int:
        """Parameters of one routed expert (w1, w2, w3)."""
        return 3 * self.dim * self.moe_inter_dim

    def param_counts(self) -> tuple[int, int]:
        """(total, activated per token). Counts the embedding, the output head, norms and
        the per-expert routing bias buffers; not the load counters or the rope cache. MTP
        modules count too (each: an MoE block, eh_proj and three norms; embedding and
        head are shared)."""
        per_block = self._attention_params() + 2 * self.dim
        dense = 3 * self.dim * self.inter_dim
        moe_fixed = (self.n_shared_experts * self.expert_params()  # shared SwiGLU
                     + self.dim * self.n_routed_experts  # router gate
                     + self.n_routed_experts)  # expert bias
        total_moe = moe_fixed + self.n_routed_experts * self.expert_params()
        active_moe = moe_fixed + self.n_activated_experts * self.expert_params()
        common = self.n_layers * per_block + self.n_dense_layers * dense + 2 * self.vocab_size * self.dim + self.dim
        mtp_fixed = self.mtp_depth * (per_block + 2 * self.dim * self.dim + 3 * self.dim)
        moe_blocks = self.n_moe_layers + self.mtp_depth
        return (common + mtp_fixed + moe_blocks * total_moe, common + mtp_fixed + moe_blocks * active_moe)

    def flops_per_token(self, seq_len: int, num_params: int | None = None, embedding_params: int | None = None) -> int:
        """6 x activated non-embedding params + the attention term 6 * L * H * (Dqk + Dv) * S
        (equal to Llama3Args' 12 * L * H * Dh * S when Dqk = Dv). Each MTP depth adds its
        block's attention term and another pass through the shared output head.

        `num_params` / `embedding_params` are accepted for signature compatibility with
        Llama3Args and ignored: the total count of an MoE model includes experts a token
        never visits, so the activated count is computed from the args."""
        _, activated = self.param_counts()
        layers = self.n_layers + self.mtp_depth
        return (6 * (activated - self.vocab_size * self.dim) + 6 * self.mtp_depth * self.vocab_size * self.dim
                + 6 * layers * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len)


DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    # Tiny, CPU-friendly, but every feature on: q LoRA, groups, sigmoid + bias, shared experts.
    "debug": DeepSeekV3Args(
        vocab_size=2048, dim=256, n_layers=6, n_dense_layers=1, inter_dim=1024, max_seq_len=4096,
        moe_inter_dim=256, n_routed_experts=8, n_shared_experts=2, n_activated_experts=3,
        n_expert_groups=4, n_limited_groups=2, score_func="sigmoid", route_scale=1.0,
        n_heads=16, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        rope_factor=1.0, original_seq_len=4096,
    ),
    # DeepSeek-V2-Lite shape (softmax routing, no groups, YaRN x40 with mscale 0.707).
    "16B": DeepSeekV3Args(
        vocab_size=102400, dim=2048, n_layers=27, n_dense_layers=1, inter_dim=10944, max_seq_len=16384,
        moe_inter_dim=1408, n_routed_experts=64, n_shared_experts=2, n_activated_experts=6,
        n_expert_groups=1, n_limited_groups=1, score_func="softmax", route_scale=1.0,
        n_heads=16, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_factor=40.0, original_seq_len=4096, mscale=0.707,
    ),
    # DeepSeek V3 / R1 (without the MTP module).
    "671B": DeepSeekV3Args(
        vocab_size=129280, dim=7168, n_layers=61, n_dense_layers=3, inter_dim=18432, max_seq_len=16384,
        moe_inter_dim=2048, n_routed_experts=256, n_shared_experts=1, n_activated_experts=8,
        n_expert_groups=8, n_limited_groups=4, score_func="sigmoid", route_scale=2.5,
        n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_factor=40.0, original_seq_len=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
    ),
}
