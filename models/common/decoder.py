"""The decoder-only skeleton every model here shares: embedding -> blocks -> norm -> head.

A model subclasses `DecoderLM`, passes a block factory and implements `_rope_cache()`.
Blocks live in a `ModuleDict` keyed "0".."L-1" so pipeline stages can delete the blocks
they do not own while parameter names stay stable for checkpoints; `forward` tolerates
a missing embedding, final norm or output head for the same reason.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common.attention import DocumentMask
from models.common.init import trunc_normal_
from models.common.moe_pool import pooled_routing
from models.common.norms import RMSNorm


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). Dense FFNs and MoE shared experts."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float) -> None:
        trunc_normal_(self.w1.weight, mean=0.0, std=std)
        trunc_normal_(self.w3.weight, mean=0.0, std=out_std)
        trunc_normal_(self.w2.weight, mean=0.0, std=out_std)


class DecoderLM(nn.Module):
    def __init__(self, args: Any, make_block: Callable[[int, Any], nn.Module]):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): make_block(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Not persistent: recomputed by init_weights, so checkpoints hold only weights.
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)

    def _rope_cache(self) -> torch.Tensor:
        """[max_seq_len, 2, rope_dim] cos/sin table (see models.common.rope.rope_cos_sin)."""
        raise NotImplementedError

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialises every parameter and buffer this (possibly pipeline-split) model holds."""
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
            trunc_normal_(self.output.weight, mean=0.0, std=final_std, a=-3 * final_std, b=3 * final_std)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [batch, seq] int ids, or [batch, seq, dim] hidden states on a pipeline
        stage without the embedding. `positions` ([seq] or [batch, seq] token positions)
        places RoPE where the tokens are not 0..seq-1: a context-parallel shard, or
        packed documents that restart at 0. `document_ids` ([batch, seq], equal within a
        packed document) makes attention block-causal (models.common.attention.DocumentMask).
        Returns logits, or hidden states on a stage without the output head."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope_cache[: h.shape[1]] if positions is None else self.rope_cache[positions]
        # The table stays fp32 (a view, shared by every block): `apply_rope` rotates in fp32
        # and keeps no per-block copy of it for backward (models/common/rope.py).
        mask = None if document_ids is None else DocumentMask(document_ids)
        with pooled_routing():  # a balance loss over every MoE layer of this forward (models/common/moe_pool.py)
            for block in self.layers.values():
                h = block(h, rope, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
