"""The attention kernel as a module, so that parallel plans can replace it from outside.

Every attention in models/ (Llama's GQA, DeepSeek's MLA) computes its q, k, v and then
calls `self.sdpa(q, k, v)`. Keeping the kernel behind a named submodule
(`layers.N.attention.sdpa`) gives context parallelism, document masking or a new
backend one place to hook in, by module name, as the TP plan does for the
projections, while the model code stays free of collectives and masks.

Layout: q [B, Hq, S, Dqk], k [B, Hkv, S, Dqk], v [B, Hkv, S, Dv] -> [B, Hq, S, Dv],
causal. Hkv may divide Hq (GQA): SDPA's `enable_gqa` broadcasts the KV heads
instead of materialising `repeat_interleave` copies of k and v.

Document masking: `DocumentMask(document_ids)` ([B, S] ids, equal within one packed
document) makes attention block-causal, so no token attends across a document
boundary. The model builds it once per forward from a tensor it is given (so pipeline
schedules split it per microbatch like any input) and hands the same object to every
layer's `sdpa(..., mask=...)`. On CUDA the mask is a flex-attention BlockMask (only
the blocks that hold allowed pairs are computed), built from each 128-row tile's
document range in O((S/128)^2), never an [S, S] tensor; elsewhere, and where flex attention
is unavailable, a dense [B, 1, S, S] boolean mask for SDPA (flex attention's backward
does not run on CPU in torch 2.13).
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
    channels and do not change the softmax. Flex attention (document masking on CUDA)
    takes Dv != Dqk, so v is not padded there.
    """

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: "DocumentMask | None" = None) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]
        if mask is not None and mask.block is not None:  # flex takes Dv != Dqk: no padding
            return _compiled_flex()(q, k, v, block_mask=mask.block, scale=self.scale, enable_gqa=gqa)
        pad = q.shape[-1] - v.shape[-1]
        if pad > 0:
            v = F.pad(v, (0, pad))
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, scale=self.scale, enable_gqa=gqa)
        return out[..., : out.shape[-1] - pad] if pad > 0 else out


class DocumentMask:
    """Block-causal attention over packed documents: query i sees key j iff j <= i and both
    lie in the same document. Built once per forward, before the blocks run (so compiled
    blocks and activation-checkpoint recomputes only read it), in the form the device runs:
    a flex-attention BlockMask on CUDA, a dense [B, 1, S, S] boolean SDPA mask elsewhere."""

    def __init__(self, document_ids: torch.Tensor, backend: str = "auto"):
        if backend not in ("auto", "flex", "sdpa"):
            raise ValueError(f"backend must be auto, flex or sdpa, got {backend!r}")
        self.document_ids = document_ids  # [B, S]
        flex = backend == "flex" or (backend == "auto" and document_ids.is_cuda and _flex_available())
        self.block = _block_causal_block_mask(document_ids) if flex else None
        self.dense = None if flex else _block_causal_dense(document_ids)


def _block_causal_dense(doc: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool, True where attention is allowed."""
    seq = doc.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)


FLEX_BLOCK = 128  # flex attention's default tile (rows and columns of one mask block)


def _block_causal_block_mask(doc: torch.Tensor):
    """The flex BlockMask of block-causal attention, built from the document ranges of each
    128 x 128 tile, without evaluating the mask over [S, S] (`create_block_mask` in eager mode
    materialises [B, 1, S, S] int64 intermediates: GBs at 16k; compiled, it costs a compile).
    `document_ids` are non-decreasing along the sequence with steps of 1 (a cumsum of document
    starts), so a tile's documents are the range [first row's, last row's]. A tile below the
    diagonal holds an allowed pair iff the q and kv ranges overlap, and is full iff both are
    the same single document; a diagonal tile is always partial. Partial tiles run the mask_mod
    per element, so the result equals create_block_mask's (tests/test_document_masking.py)."""
    from torch.nn.attention.flex_attention import BlockMask

    bsz, seq = doc.shape
    n = -(-seq // FLEX_BLOCK)
    starts = torch.arange(n, device=doc.device) * FLEX_BLOCK
    first = doc[:, starts]  # [B, n]: each tile's first document
    last = doc[:, torch.clamp_max(starts + FLEX_BLOCK - 1, seq - 1)]  # [B, n]: its last
    q_first, q_last = first[:, :, None], last[:, :, None]  # [B, nq, 1]
    k_first, k_last = first[:, None, :], last[:, None, :]  # [B, 1, nk]
    below = torch.ones(n, n, dtype=torch.bool, device=doc.device).tril(-1)  # kv tile before q tile
    diagonal = torch.eye(n, dtype=torch.bool, device=doc.device)
    overlap = (q_first <= k_last) & (k_first <= q_last)  # [B, nq, nk]
    full = below & (q_first == q_last) & (k_first == k_last) & (q_first == k_first)
    # The ragged last tile (S % 128 != 0) is partial: its mask_mod pads past S.
    if seq % FLEX_BLOCK:
        full[:, -1, :] = False
        full[:, :, -1] = False
    partial = ((below & overlap) | diagonal) & ~full

    def sparse(blocks: torch.Tensor):
        # [B, 1, nq] counts and [B, 1, nq, nk] indices, the listed tiles first in ascending order.
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
        return blocks.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    def block_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    kv_num, kv_idx = sparse(partial)
    full_num, full_idx = sparse(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=block_causal, seq_lengths=(seq, seq))


def _flex_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


_FLEX = None


def _compiled_flex():
    """flex_attention compiled once: its eager form materialises the scores and is for debugging only."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX
