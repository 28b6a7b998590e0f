"""Document structure of packed windows, for `data.document_masking`.

Documents are packed as [BOS] text [EOS], so a window's documents are found from its
tokens alone, whatever the source: a document starts at each BOS, right after each EOS
(tokenizers without a BOS), and at the window's first token (the tail of a document cut
by the window boundary counts as its own document).
The model gets, as keyword inputs that pipeline schedules split per microbatch like the
tokens, `document_ids` (block-causal attention, models/common/attention.py) and
`positions` that restart at 0 at each document (RoPE).
"""

from __future__ import annotations

import torch

from configuration.fields import ConfigError


def document_inputs(inputs: torch.Tensor, bos_id: int | None, eos_id: int | None = None) -> dict[str, torch.Tensor]:
    """{"positions", "document_ids"}, both [B, S] int64, for a [B, S] batch of token ids."""
    seq = inputs.shape[1]
    idx = torch.arange(seq, device=inputs.device).expand_as(inputs)
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    if bos_id is not None:
        starts |= inputs == bos_id
    if eos_id is not None:
        starts[:, 1:] |= inputs[:, :-1] == eos_id
    starts[:, 0] = True
    document_ids = torch.cumsum(starts.to(torch.int64), dim=1)
    last_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return {"positions": idx - last_start, "document_ids": document_ids}


class ModelInputs:
    """The extra keyword inputs of the model for a batch: none, or the document structure."""

    def __init__(self, document_masking: bool, tokenizer):
        self.document_masking = document_masking
        self.bos_id, self.eos_id = tokenizer.bos_id, tokenizer.eos_id
        if document_masking and self.bos_id is None and self.eos_id is None:
            raise ConfigError("config error: data.document_masking: the tokenizer has neither a BOS nor an EOS "
                              "token, so packed documents cannot be told apart; use a tokenizer that has one")

    def __call__(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return document_inputs(inputs, self.bos_id, self.eos_id) if self.document_masking else {}
