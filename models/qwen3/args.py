"""Qwen3 hyper-parameters (dense and MoE), the published flavors, and parameter / FLOP counts.

Where Qwen3 differs from Llama 3: `head_dim` is its own field (Qwen3-0.6B has 16 heads of
128 on a width of 1024), the FFN width is given, not derived, q and k get a per-head
RMSNorm (QK-norm) before RoPE, RoPE theta is 1e6, the small flavors tie the embedding
and the output head, and the MoE flavors route every token to 8 of 128 small experts
(softmax scores, top-k weights renormalised, no shared expert, no routing bias).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Qwen3Args:
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151936
    # Dense SwiGLU width (every block of a dense model; `mlp_only_layers` of a MoE model).
    ffn_hidden_dim: int = 12288
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960
    # The output head is the embedding matrix (one parameter). Qwen3-0.6B, 1.7B and 4B.
    tie_embeddings: bool = False
    depth_init: bool = True

    # --- MoE (n_routed_experts = 0: dense) ---
    n_routed_experts: int = 0
    n_activated_experts: int = 8  # top-k
    moe_inter_dim: int = 768
    # Normalise the top-k softmax weights to sum to 1 (HF `norm_topk_prob`).
    route_norm: bool = True
    # Block i is MoE iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (HF's rule).
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # Load-balancing loss coefficient; 0 disables it. With scope "model" it is HF's
    # router_aux_loss_coef (the loss is transformers' load_balancing_loss_func: one Switch loss
    # over every MoE layer's routing of a forward, top_k when balanced).
    aux_loss_coeff: float = 0.0
    # "model": HF's loss pooled over the layers (models/common/moe_pool.py); "batch": one such loss
    # per layer, each 1 when balanced (sum over L layers: L / top_k x HF's at equal loads);
    # "sequence": per sequence and layer (DeepSeek V3's).
    aux_loss_scope: Literal["model", "batch", "sequence"] = "model"
    # Aux-loss-free bias update rate: off for Qwen3 (its checkpoints have no routing bias).
    load_balance_coeff: float = 0.0
    use_grouped_mm: bool = True

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def moe_enabled(self) -> bool:
        return self.n_routed_experts > 0

    def is_moe_layer(self, layer_id: int) -> bool:
        return (self.moe_enabled and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    # ---- counts (analytic; tests check them against a meta-device model) ----
    def param_counts(self) -> tuple[int, int]:
        """(total, activated per token) as transformers counts them: embedding and head (once
        when tied), routers; no buffers (not the MoE layers' all-zero `expert_bias`)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.kv_heads) + 2 * self.head_dim
        per_block = attn + 2 * self.dim
        dense = 3 * self.dim * self.ffn_hidden_dim
        expert = 3 * self.dim * self.moe_inter_dim
        moe_fixed = self.dim * self.n_routed_experts
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        n_moe = self.n_moe_layers
        common = self.n_layers * per_block + (self.n_layers - n_moe) * dense + emb + self.dim + n_moe * moe_fixed
        return (common + n_moe * self.n_routed_experts * expert, common + n_moe * self.n_activated_experts * expert)

    def flops_per_token(self, seq_len: int, num_params: int | None = None, embedding_params: int | None = None) -> int:
        """6 x activated non-embedding params + the attention term 12 * L * H * Dh * S (Llama3Args'
        convention). The tied head still does its matmul: its params count as non-embedding once.
        `num_params` / `embedding_params` are ignored (signature compatibility)."""
        _, activated = self.param_counts()
        embedding = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return 6 * (activated - embedding) + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

def _dense(dim: int, n_layers: int, n_heads: int, ffn: int, tie: bool) -> Qwen3Args:
    return Qwen3Args(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128, ffn_hidden_dim=ffn,
                     tie_embeddings=tie)


def _moe(dim: int, n_layers: int, n_heads: int, ffn: int, moe_ffn: int) -> Qwen3Args:
    return Qwen3Args(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, head_dim=128, ffn_hidden_dim=ffn,
                     n_routed_experts=128, n_activated_experts=8, moe_inter_dim=moe_ffn,
                     aux_loss_coeff=0.001)  # the Qwen3 recipe's router_aux_loss_coef, HF's pooled loss


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # Tiny and CPU-friendly with every dense feature on: GQA, head_dim != dim / n_heads, tied head.
    "debug": Qwen3Args(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, vocab_size=2048,
                       ffn_hidden_dim=768, max_seq_len=4096, tie_embeddings=True),
    # Tiny MoE: 8 experts, top 2, one dense block first (mlp_only_layers), untied.
    "debug_moe": Qwen3Args(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, vocab_size=2048,
                           ffn_hidden_dim=768, max_seq_len=4096, n_routed_experts=8, n_activated_experts=2,
                           moe_inter_dim=128, mlp_only_layers=[0], aux_loss_coeff=0.001 * 2,
                           aux_loss_scope="batch"),  # per layer: the layout tests' and golden curve's scope
    "0.6B": _dense(1024, 28, 16, 3072, tie=True),
    "1.7B": _dense(2048, 28, 16, 6144, tie=True),
    "4B": _dense(2560, 36, 32, 9728, tie=True),
    "8B": _dense(4096, 36, 32, 12288, tie=False),
    "14B": _dense(5120, 40, 40, 17408, tie=False),
    "32B": _dense(5120, 64, 64, 25600, tie=False),
    "30B-A3B": _moe(2048, 48, 32, 6144, 768),
    "235B-A22B": _moe(4096, 94, 64, 12288, 1536),
}
