"""DeepSeek V3 multi-token prediction (MTP): D extra modules after the main model.

Module k (1..D) predicts, at position i, the token k + 1 positions ahead (t_{i+k+1}),
keeping the causal chain: it combines the previous depth's representation of token i
with the embedding of token i + k, runs one transformer block, and reuses the main
model's output head (DeepSeek-V3 technical report, section 2.2):

    h^0     = norm(main model's last hidden state)                 (what the head sees)
    h'^k    = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1})])        (concat on features)
    h^k     = norm_k(block_k(h'^k))                                 (HF: shared_head.norm)
    logits^k = output(h^k)                                          (shared head)

The embedding and the output head are the main model's (no copies). Training needs the
tokens i + k, which lie beyond the input window for the last positions: they come
from the labels (labels[i] = t_{i+1}, so Emb(t_{i+k}) = Emb(labels[i + k - 1])), passed
to the model's forward as `mtp_labels`. Targets are the labels shifted by k, the last
k positions ignored (`mtp_targets`); positions beyond the window only ever see later
positions' garbage through causal attention, and those positions are ignored.

Layout for the parallelisms: the MTP modules are the top-level child `mtp` (a
ModuleDict "0".."D-1"), registered after `output`, so pipeline splitting puts them on
the last stage. With pipeline parallelism the embedding lives on the first stage: it
embeds the MTP tokens there, in the same call as the input tokens, and the stages
pass those embeddings along with the hidden state (extra stage outputs/inputs), so no
embedding copy or gradient sync is needed. HF checkpoints store module k as
`model.layers.{n_layers + k - 1}.*` (see state_dict_adapter.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.common.init import trunc_normal_
from models.common.norms import RMSNorm

IGNORE_INDEX = -100


def mtp_embedding_ids(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """[depth * B, S] token ids whose embeddings MTP modules 1..depth combine: module k at
    position i needs t_{i+k} = labels[i + k - 1]. Ignored labels (and positions past the
    window) get id 0; their predictions are ignored by `mtp_targets`."""
    ids = labels.clamp_min(0)
    return torch.cat([torch.roll(ids, -(k - 1), dims=1) for k in range(1, depth + 1)], dim=0)


def mtp_targets(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """[depth * B, S] targets of MTP modules 1..depth: module k at position i predicts
    t_{i+k+1} = labels[i + k]; the last k positions have none (IGNORE_INDEX)."""
    out = []
    for k in range(1, depth + 1):
        t = torch.roll(labels, -k, dims=1)
        t[:, -k:] = IGNORE_INDEX
        out.append(t)
    return torch.cat(out, dim=0)


class MTPLayer(nn.Module):
    """One MTP depth: enorm / hnorm, eh_proj [2D -> D], a transformer block, its final norm."""

    def __init__(self, block: nn.Module, dim: int, norm_eps: float):
        super().__init__()
        self.enorm = RMSNorm(dim, norm_eps)
        self.hnorm = RMSNorm(dim, norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, norm_eps)

    def forward(self, h_prev: torch.Tensor, emb: torch.Tensor, rope: torch.Tensor, mask=None) -> torch.Tensor:
        """h_prev, emb: [B, S, D] (previous depth's normed hidden, embeddings of t_{i+k});
        `mask`: the document mask of data.document_masking, if any."""
        h = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h_prev)], dim=-1))
        return self.norm(self.block(h, rope, mask=mask))

    def init_weights(self) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        trunc_normal_(self.eh_proj.weight, mean=0.0, std=0.02)
        self.block.init_weights()


def pipeline_tensor(t: torch.Tensor) -> torch.Tensor:
    """Pipeline stages exchange plain, full tensors (parallelisms/tensor_parallel.py); under
    sequence parallel the embedding returns a sequence-sharded DTensor, gathered here."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
