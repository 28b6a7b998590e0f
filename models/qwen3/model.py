"""Qwen3 (dense and MoE) in plain PyTorch: Llama 3's GQA attention plus QK-norm, SwiGLU or MoE blocks.

Reused as they are: the decoder skeleton (models/common/decoder.py), SDPA, RMSNorm, the
rotate-half RoPE (Qwen3's HF layout, so q/k load unpermuted), Llama 3's attention
projections and the MoE layer (models/common/moe.py, configured as Qwen3 routes: softmax,
normalised top-k, no shared expert, no routing bias). What is Qwen3's own:

- QK-norm: one RMSNorm over head_dim, one gain vector for all heads, applied to every q
  and k head before RoPE. It is per head, so a TP rank holding whole heads computes it
  exactly on its own heads (models/qwen3/parallelize.py).
- Tied embeddings (`tie_embeddings`): `output.weight` *is* `tok_embeddings.weight`, one
  parameter, as in HF (its gradient is the sum of both uses). Materialising a meta model
  (`to_empty`) gives each module its own tensor, so `init_weights` ties them again.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.common.attention import DocumentMask
from models.common.block import MoETransformerBlock
from models.common.decoder import DecoderLM
from models.common.moe import MoEArgs, inactive_expert_params
from models.common.norms import RMSNorm
from models.common.rope import apply_rope, llama3_inv_freq, rope_cos_sin
from models.llama3.model import Attention
from models.qwen3.args import Qwen3Args


class Qwen3Attention(Attention):
    """Llama 3's projections (head_dim from the args, not dim / n_heads) with QK-norm."""

    def __init__(self, args: Qwen3Args, qk_norm_eps: float | None = None):
        super().__init__(args)
        eps = args.norm_eps if qk_norm_eps is None else qk_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 head counts: under TP these projections hold only the local heads.
        q = self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim))  # [B, S, H, Dh]
        k = self.k_norm(self.wk(x).view(bsz, seqlen, -1, self.head_dim))  # [B, S, Hkv, Dh]
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=mask)  # [B, H, S, Dh]
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_weights(self, out_std: float) -> None:
        super().init_weights(out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


def moe_args_from(args: Qwen3Args) -> MoEArgs:
    return MoEArgs(num_experts=args.n_routed_experts, top_k=args.n_activated_experts, num_shared_experts=0,
                   score_func="softmax", route_norm=args.route_norm, route_scale=1.0, n_groups=1, topk_groups=1,
                   aux_loss_coeff=args.aux_loss_coeff, aux_loss_scope=args.aux_loss_scope,
                   use_grouped_mm=args.use_grouped_mm)


class Qwen3Block(MoETransformerBlock):
    """Pre-norm block with QK-norm attention; MoE where `args.is_moe_layer(layer_id)`. The module
    names are DeepSeek V3's (one shared block), so the MoE TP plan and AC policies apply as they are."""

    def __init__(self, layer_id: int, args: Qwen3Args):
        moe = moe_args_from(args) if args.is_moe_layer(layer_id) else None
        super().__init__(layer_id, args, Qwen3Attention(args), moe, args.ffn_hidden_dim)


class Qwen3(DecoderLM):
    def __init__(self, args: Qwen3Args):
        super().__init__(args, Qwen3Block)
        self.tie()

    def tie(self) -> None:
        """output.weight = tok_embeddings.weight when the args tie them (and this part holds both)."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        # Tied: the head's init (std dim^-0.5) is the one that stays (it runs after the embedding's).
        self.tie()
        super().init_weights(buffer_device)

    def _rope_cache(self) -> torch.Tensor:
        a = self.args
        return rope_cos_sin(llama3_inv_freq(a.head_dim, a.rope_theta, None), a.max_seq_len)


def count_params(model: nn.Module) -> tuple[int, int]:
    """(total, activated per token) of an unsharded (meta) model as HF counts them: every
    parameter once (a tied head is the embedding), no buffers."""
    total = sum(p.numel() for p in model.parameters())
    return total, total - inactive_expert_params(model)
