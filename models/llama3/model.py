"""Llama 3 in plain PyTorch: GQA attention, RoPE with llama3 scaling, SwiGLU, RMSNorm.

The model knows nothing about parallelism; the embedding -> blocks -> head skeleton
(and why blocks sit in a ModuleDict) is in models/common/decoder.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from models.common.attention import DocumentMask, SDPA
from models.common.decoder import DecoderLM, FeedForward
from models.common.init import trunc_normal_
from models.common.norms import RMSNorm
from models.common.rope import apply_rope, llama3_inv_freq, rope_cos_sin
from models.llama3.args import Llama3Args


class Attention(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.sdpa = SDPA()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 head counts: under TP these projections hold only the local heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.sdpa(q, k, v, mask=mask)  # [B, H, S, Dh]
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_weights(self, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=out_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Llama3Args):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # Depth-scaled init keeps the residual stream's variance flat in deep models.
        self.out_std = 0.02 / math.sqrt(2 * (layer_id + 1)) if args.depth_init else 0.02 / math.sqrt(2 * args.n_layers)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask=mask)  # a keyword: TP plans prepare (x, rope)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_std)
        self.feed_forward.init_weights(0.02, self.out_std)


class Llama3(DecoderLM):
    def __init__(self, args: Llama3Args):
        super().__init__(args, TransformerBlock)

    def _rope_cache(self) -> torch.Tensor:
        a = self.args
        return rope_cos_sin(llama3_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling), a.max_seq_len)
