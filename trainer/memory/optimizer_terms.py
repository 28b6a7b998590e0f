"""The optimizer's share of a rank's memory: its persistent states and its step's temporaries.

Why a module of its own: AdamW's terms are one line each, Muon's depend on which
parameters its rule selects and how each matrix is sharded, and the estimate should read
both the same way (`optimizer_terms`, from the busiest rank's `RankParams.matrices`).

AdamW / Adam: two fp32 moments per parameter; the foreach step (the CPU default) one
fp32 temporary the size of its parameters, fused (the CUDA default) none.

Muon (trainer/muon.py), on the parameters its rule selects (`optimizer.muon_params` minus
`muon_exclude`, >= 2-D): one momentum buffer the size of the local fp32 shard, AdamW's two
moments and foreach temporary on the rest. Its step, Muon's group first and then AdamW's
(so the larger of the two counts, not their sum), holds on the training device:

- every Muon parameter's update and its result, in NS's dtype (bf16 on GPU, fp32 on CPU):
  `_muon_step` keeps both lists until the last update is applied;
- the largest transient of one stack of sharded matrices (parallelisms/muon_assembly.py):
  the stack, what the all-to-all receives and its concatenation, then NS on the whole
  matrices this rank holds (ceil(J / ranks) of the J matrices); or of one whole local
  parameter (a 3-D expert tensor is a batch of matrices);
- NS's own temporaries per m x n matrix (a = min(m, n), b = max): at most
  max(4 a^2 + a b, a^2 + 4 a b) elements (the Gram matrix, its square and their sums, or
  the next iterate's three terms).

Under `fsdp_cpu_offload` the states stay in host memory (not counted), Muon's temporaries
do not: its updates are assembled and orthogonalised on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class OptimizerTerms:
    states: int  # persistent bytes: moments and momentum buffers
    step: int  # the step's temporaries, beyond the gradients
    device_step: int  # what of `step` stays on the device under fsdp_cpu_offload (Muon's assembly and NS)
    muon_params: int  # local fp32 bytes of the parameters on Muon (0: AdamW)


def ns_temporaries(m: int, n: int) -> int:
    """Elements `newton_schulz` allocates beyond its input for one m x n matrix, at most."""
    a, b = min(m, n), max(m, n)
    return max(4 * a * a + a * b, a * a + 4 * a * b)


def _muon_step(matrices: dict, esize: int) -> int:
    """Peak bytes of `Muon._muon_step` on these (local shape, global shape, ranks) matrices."""
    held = sum(math.prod(local) for local, _, _ in matrices.values())
    stacks: dict = {}
    worst = 0
    for local, glob, ranks in matrices.values():
        if ranks == 1:  # whole here: NS on its local batch of matrices
            batch = math.prod(local[:-2])
            worst = max(worst, batch * ns_temporaries(*local[-2:]))
        else:
            stacks.setdefault((local, glob, ranks), []).append(local)
    for (local, glob, ranks), members in stacks.items():
        rows = len(members) * math.prod(local[:-2])
        here = -(-rows // ranks)  # whole matrices this rank orthogonalises
        stack = rows * math.prod(local[-2:])
        whole = here * math.prod(glob[-2:])
        # the stack, the all-to-all's receive buffer and their concatenation; then NS on the whole ones
        worst = max(worst, stack + 2 * whole, whole + here * ns_temporaries(*glob[-2:]))
    return (2 * held + worst) * esize


def optimizer_terms(cfg, matrices: dict, param_bytes: int, device: str, impl: str) -> OptimizerTerms:
    """The terms of the busiest rank: `matrices` and `param_bytes` from its `RankParams`."""
    opt = cfg.optimizer
    foreach = impl == "foreach"
    if opt.name != "muon":
        return OptimizerTerms(2 * param_bytes, param_bytes if foreach else 0, 0, 0)
    from trainer.muon import is_muon_param

    meta = {name: torch.empty(glob, device="meta") for name, (_, glob, _) in matrices.items()}
    muon = {n: v for n, v in matrices.items() if is_muon_param(n, meta[n], opt.muon_params, opt.muon_exclude)}
    muon_bytes = sum(math.prod(local) for local, _, _ in muon.values()) * 4
    dtype = {"bfloat16": 2, "float32": 4}.get(opt.muon_ns_dtype, 2 if device == "cuda" else 4)
    muon_step = _muon_step(muon, dtype)
    adamw = param_bytes - muon_bytes
    return OptimizerTerms(2 * adamw + muon_bytes, max(muon_step, adamw if foreach else 0), muon_step, muon_bytes)
