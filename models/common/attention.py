"""The attention kernel as a module, so that parallel plans can replace it from outside.

Every attention in models/ (Llama's GQA, DeepSeek's MLA) computes its q, k, v and then
calls `self.sdpa(q, k, v)`. Keeping the kernel behind a named submodule
(`layers.N.attention.sdpa`) gives context parallelism, document masking or a new
backend one place to hook in, by module name, as the TP plan does for the
projections, while the model code stays free of collectives and masks.

Layout: q [B, Hq, S, Dqk], k [B, Hkv, S, Dqk], v [B, Hkv, S, Dv] -> [B, Hq, S, Dv],
causal. Hkv may divide Hq (GQA): SDPA's `enable_gqa` broadcasts the KV heads
instead of materialising `repeat_interleave` copies of k and v.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SDPA(nn.Module):
    """Causal scaled-dot-product attention with GQA and unequal q/k and v head dims.

    `scale` defaults to 1/sqrt(Dqk). When Dv < Dqk (MLA), v is zero-padded to Dqk and
    the padded output channels are dropped: SDPA's fused kernels (flash on CPU and
    CUDA) need equal head dims, and only the math backend (an [S, S] score matrix)
    takes unequal ones. The padding is exact: zero channels of v produce zero output
    channels and do not change the softmax.
    """

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pad = q.shape[-1] - v.shape[-1]
        if pad > 0:
            v = F.pad(v, (0, pad))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out[..., : out.shape[-1] - pad] if pad > 0 else out
