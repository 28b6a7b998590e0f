"""Rotary position embeddings in the rotate-half layout (the Hugging Face layout).

We use the rotate-half layout rather than Meta's interleaved complex layout so
that Hugging Face checkpoints load without permuting q/k weights, and so that no
complex tensors reach DTensor or torch.compile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class RopeScaling:
    """Llama 3.1 frequency scaling (`rope_type = "llama3"`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def llama3_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled).float()


def rope_cos_sin(inv_freq: torch.Tensor, max_seq_len: int, scale: float = 1.0) -> torch.Tensor:
    """Returns a [max_seq_len, 2, head_dim] cache of (cos, sin), each already
    duplicated over both halves, optionally multiplied by an attention scale
    (YaRN's mscale)."""
    t = torch.arange(max_seq_len, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.to(torch.float32))
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.stack([emb.cos() * scale, emb.sin() * scale], dim=1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class _RotateInTableDtype(torch.autograd.Function):
    """y = x * cos + rotate_half(x) * sin, computed in the table's dtype and rounded once to
    x's. Backward is the inverse rotation of the gradient (rotate_half is orthogonal:
    its transpose is cat(u2, -u1)), so only cos and sin are saved: views of the one table
    every block shares. Autograd through the plain expression would keep two fp32 copies of
    q and k per block for backward."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        xf = x.to(cos.dtype)
        return (xf * cos + rotate_half(xf) * sin).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        g = grad.to(cos.dtype)
        g1, g2 = (g * sin).chunk(2, dim=-1)
        return (g * cos + torch.cat([g2, -g1], dim=-1)).to(ctx.x_dtype), None, None


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; cos_sin: [seq, 2, head_dim], or [batch, seq, 2,
    head_dim] when each sample has its own positions.

    Computed in the table's dtype (fp32: the model hands every block a view of its fp32
    buffer, and FSDP's blocks do not cast their inputs, parallelisms/fsdp.py) and rounded
    once to x's dtype. In bf16 the cos/sin values would carry a 2^-9 relative error and the
    rotation two more roundings: TorchTitan and Megatron rotate in fp32 too."""
    cos = cos_sin[..., 0, :].unsqueeze(-2)  # [(batch,) seq, 1, head_dim]
    sin = cos_sin[..., 1, :].unsqueeze(-2)
    return _RotateInTableDtype.apply(x, cos, sin)
