"""Llama 3 in plain PyTorch: GQA attention, RoPE with llama3 scaling, SwiGLU, RMSNorm.

The model knows nothing about parallelism. Blocks live in a `ModuleDict` keyed
"0".."L-1" so that pipeline stages can delete the blocks they do not own while
parameter names stay stable for checkpoints; `forward` tolerates a missing
embedding, final norm or output head for the same reason.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

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

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 head counts: under TP these projections hold only the local heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_weights(self, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=out_std)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=out_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Llama3Args):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # Depth-scaled init keeps the residual stream's variance flat in deep models.
        self.out_std = 0.02 / math.sqrt(2 * (layer_id + 1)) if args.depth_init else 0.02 / math.sqrt(2 * args.n_layers)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_std)
        self.feed_forward.init_weights(self.out_std)


class Llama3(nn.Module):
    def __init__(self, args: Llama3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Not persistent: recomputed by init_weights, so checkpoints hold only weights.
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)

    def _rope_cache(self) -> torch.Tensor:
        a = self.args
        return rope_cos_sin(llama3_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling), a.max_seq_len)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialises every parameter this (possibly pipeline-split) model holds."""
        with torch.device(buffer_device or self.rope_cache.device):
            self.rope_cache = self._rope_cache()
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for block in self.layers.values():
            block.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            final_std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_std, a=-3 * final_std, b=3 * final_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [batch, seq] int ids, or [batch, seq, dim] hidden states on a
        pipeline stage without the embedding. Returns logits, or hidden states on
        a stage without the output head."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope_cache[: h.shape[1]]
        for block in self.layers.values():
            h = block(h, rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
