"""The pre-norm decoder block shared by the MoE families (DeepSeek V3, Qwen3).

Why one class: the block is the seam TP plans, AC policies, the HF adapters and the
pipeline split all key on by module name (`attention_norm`, `attention`, `ffn_norm`, and
`feed_forward` for a dense block or `moe` for an MoE block, never both). A family brings
only its attention module and its `MoEArgs`; the block's structure, residuals and init
stay in one place, so a change to them reaches every family at once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from models.common.attention import DocumentMask
from models.common.decoder import FeedForward
from models.common.moe import MoE, MoEArgs
from models.common.norms import RMSNorm


def depth_scaled_std(layer_id: int, args: Any) -> float:
    """Init std of the weights that write into the residual stream: scaled by depth, so the
    stream's variance stays flat in deep models (`args.depth_init`), else by the layer count."""
    return 0.02 / math.sqrt(2 * (layer_id + 1)) if args.depth_init else 0.02 / math.sqrt(2 * args.n_layers)


class MoETransformerBlock(nn.Module):
    """h = x + attention(attention_norm(x)); out = h + ffn(ffn_norm(h)), where ffn is `moe`
    (MoE(dim, args.moe_inter_dim, moe_args)) when `moe_args` is given, else `feed_forward`
    (SwiGLU of width `dense_hidden_dim`). `args` gives dim, norm_eps, moe_inter_dim,
    depth_init and n_layers."""

    def __init__(self, layer_id: int, args: Any, attention: nn.Module, moe_args: MoEArgs | None,
                 dense_hidden_dim: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe_enabled = moe_args is not None
        if self.moe_enabled:
            self.moe = MoE(args.dim, args.moe_inter_dim, moe_args)
        else:
            self.feed_forward = FeedForward(args.dim, dense_hidden_dim)
        self.out_std = depth_scaled_std(layer_id, args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask=mask)  # a keyword: TP plans prepare (x, rope)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(0.02, self.out_std)
