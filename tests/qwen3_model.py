"""A test-only model with a different attention: Llama 3 plus Qwen3's QK-norm.

It lives in tests/ on purpose: it proves that a new model plugs into the trainer, TP,
FSDP, AC and the memory estimator with only a folder's worth of code (args, model, TP
plan, spec) and no edit to trainer/ or parallelisms/. Select it with
`--model.name tests.qwen3_model` (the registry imports a module path and takes `spec`).

QK-norm: an RMSNorm over head_dim applied to every q and k head before RoPE, one gain
vector shared by all heads.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from models.common.norms import RMSNorm
from models.common.rope import apply_rope
from models.llama3 import LLAMA3_FLAVORS, summarize
from models.llama3.args import Llama3Args
from models.llama3.model import Attention, Llama3, TransformerBlock
from models.llama3.parallelize import parallelize_llama
from models.spec import ModelSpec


@dataclasses.dataclass
class Qwen3Args(Llama3Args):
    qk_norm_eps: float = 1e-6


class QKNormAttention(Attention):
    def __init__(self, args: Qwen3Args):
        super().__init__(args)
        self.q_norm = RMSNorm(self.head_dim, args.qk_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.qk_norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim))  # [B, S, H, Dh]
        k = self.k_norm(self.wk(x).view(bsz, seqlen, -1, self.head_dim))  # [B, S, Hkv, Dh]
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=mask)  # [B, H, S, Dh]
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_weights(self, out_std: float) -> None:
        super().init_weights(out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class Qwen3Block(TransformerBlock):
    def __init__(self, layer_id: int, args: Qwen3Args):
        super().__init__(layer_id, args)
        self.attention = QKNormAttention(args)


class Qwen3(Llama3):
    def __init__(self, args: Qwen3Args):
        nn.Module.__init__(self)
        super(Llama3, self).__init__(args, Qwen3Block)


class HeadShardedNorm(ParallelStyle):
    """TP for a norm over head_dim applied to the local heads: the gain is a replicated
    DTensor and the input is seen as sharded on the heads (dim 2), so DTensor sums the
    gain's gradient over the TP ranks' heads."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))

        def inputs(mod, args, mesh):
            return (DTensor.from_local(args[0], mesh, [Shard(2)], run_check=False), *args[1:])

        def outputs(mod, out, mesh):
            return out.to_local()

        return distribute_module(module, mesh, partition, inputs, outputs)


def parallelize_qwen3(model: nn.Module, tp_mesh, parallelism_cfg) -> None:
    parallelize_llama(model, tp_mesh, parallelism_cfg)
    for key, block in model.layers.items():
        for name in ("q_norm", "k_norm"):
            HeadShardedNorm()._apply(getattr(block.attention, name), tp_mesh)


FLAVORS = {"debug": Qwen3Args(**{**dataclasses.asdict(LLAMA3_FLAVORS["debug_small"]), "rope_scaling": None})}

spec = ModelSpec(name="tests.qwen3_model", flavors=FLAVORS, model_cls=Qwen3, summary_fn=summarize,
                 tensor_parallel_fn=parallelize_qwen3)
