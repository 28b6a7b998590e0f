"""A test-only model outside the registry: Llama 3 with Qwen3's QK-norm attention.

It lives in tests/ on purpose: it proves the out-of-tree path, that a module the registry
imports by path (`--model.name tests.qwen3_model`, which takes its `spec`) plugs into the
trainer, TP, FSDP, AC and the memory estimator with no edit to trainer/ or parallelisms/.
It composes pieces that exist (Llama 3's model and TP plan, models/qwen3's attention,
parallelisms/block_tp.py's HeadShardedNorm); the native family is models/qwen3.

QK-norm: an RMSNorm over head_dim applied to every q and k head before RoPE, one gain
vector shared by all heads."""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from models.llama3 import LLAMA3_FLAVORS, summarize
from models.llama3.args import Llama3Args
from models.llama3.model import Llama3, TransformerBlock
from models.llama3.parallelize import parallelize_llama
from models.qwen3.model import Qwen3Attention
from models.spec import ModelSpec
from parallelisms.block_tp import HeadShardedNorm


@dataclasses.dataclass
class Qwen3Args(Llama3Args):
    qk_norm_eps: float = 1e-6


class Qwen3Block(TransformerBlock):
    def __init__(self, layer_id: int, args: Qwen3Args):
        super().__init__(layer_id, args)
        self.attention = Qwen3Attention(args, args.qk_norm_eps)


class Qwen3(Llama3):
    def __init__(self, args: Qwen3Args):
        nn.Module.__init__(self)
        super(Llama3, self).__init__(args, Qwen3Block)


def parallelize_qwen3(model: nn.Module, tp_mesh, parallelism_cfg) -> None:
    parallelize_llama(model, tp_mesh, parallelism_cfg)
    for key, block in model.layers.items():
        for name in ("q_norm", "k_norm"):
            HeadShardedNorm()._apply(getattr(block.attention, name), tp_mesh)


FLAVORS = {"debug": Qwen3Args(**{**dataclasses.asdict(LLAMA3_FLAVORS["debug_small"]), "rope_scaling": None})}

spec = ModelSpec(name="tests.qwen3_model", flavors=FLAVORS, model_cls=Qwen3, summary_fn=summarize,
                 tensor_parallel_fn=parallelize_qwen3)
