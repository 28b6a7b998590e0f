"""Llama 3 hyper-parameters and the published flavors."""

from __future__ import annotations

from dataclasses import dataclass

from models.common.rope import RopeScaling


@dataclass
class Llama3Args:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 131072
    # Init std of the weights that write into the residual stream is scaled by depth.
    depth_init: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def flops_per_token(self, seq_len: int, num_params: int, embedding_params: int) -> int:
        """6 * non-embedding params + the attention term 12 * L * H * Dh * S: TorchTitan's
        convention, which counts attention over all S keys (not causal); trainer/metrics.py
        also reports MFU with this term halved, the FLOPs a causal kernel does."""
        return 6 * (num_params - embedding_params) + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


def _llama3_1_scaling() -> RopeScaling:
    return RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


LLAMA3_FLAVORS: dict[str, Llama3Args] = {
    "debug": Llama3Args(dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=500000, max_seq_len=4096),
    # Odd layer count and GQA: used by tests to cover uneven splits.
    "debug_small": Llama3Args(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=2048, multiple_of=32, max_seq_len=1024),
    "8B": Llama3Args(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
        rope_theta=500000, rope_scaling=_llama3_1_scaling(),
    ),
    "70B": Llama3Args(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096,
        rope_theta=500000, rope_scaling=_llama3_1_scaling(),
    ),
    "405B": Llama3Args(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096,
        rope_theta=500000, rope_scaling=_llama3_1_scaling(),
    ),
}
