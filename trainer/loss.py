"""Cross entropy summed over valid tokens; the trainer divides by the global count.

Summing per microbatch and dividing by the number of valid tokens in the whole
global batch (all microbatches, all data-parallel ranks) makes the gradient
independent of how the batch is split, so 1x8 equals 4x2 and 2 ranks equal 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.configurable import opt

IGNORE_INDEX = -100


@dataclass
class LossConfig:
    """[loss]"""

    chunked_ce: bool = opt(False, "Fuse the output projection into a chunked cross entropy that never "
                           "materialises the full [tokens, vocab] logits.")
    ce_chunk_size: int = opt(1024, "Tokens per chunk for chunked_ce.", min=1)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token losses, in fp32, ignoring IGNORE_INDEX labels."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX,
                           reduction="sum")
