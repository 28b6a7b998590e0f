"""The optimizer's share of a rank's memory: its persistent states and its step's temporaries.

Why a module of its own: AdamW's terms are one line each, Muon's depend on which
parameters its rule selects and how each matrix is sharded, and the estimate should read
both the same way (`optimizer_terms`, from the busiest rank's `RankParams.matrices`).

AdamW / Adam: two fp32 moments per parameter; the foreach step (the CPU default) one
fp32 temporary the size of its parameters, fused (the CUDA default) none.

Muon (trainer/muon.py), on the parameters its rule selects (`optimizer.muon_params` minus
`muon_exclude`, >= 2-D): one momentum buffer the size of the local fp32 shard, AdamW's two
moments and foreach temporary on the rest. Its step, Muon's group first and then AdamW's
(so the larger of the two counts, not their sum), goes through the Muon parameters a stack
at a time (parallelisms/muon_assembly.py: those of one layout; a parameter whose matrices are
whole here and not replicated is a stack of its own), each freed before the next is built,
so it holds on the training device the largest of one stack's phases, in NS's dtype (bf16 on
GPU, fp32 on CPU) unless said:

- build: this rank's rows of the stack (all of them, or its replica's chunk), plus one
  parameter's fp32 Nesterov update (g + mu buf);
- assembly (matrices sharded over > 1 rank): the stack and what the all-to-all receives, then
  that and its concatenation (the stack is freed once sent); back: the whole results and the
  send buffer, then that and the rows received;
- NS on the whole matrices this rank holds (ceil(J_R / ranks) of the J_R rows its replica
  takes), plus NS's own temporaries for one chunk of them (`ns_chunk`: as many matrices as
  keep those within NS_CHUNK_BOUND x the matrices held, at least one), per m x n matrix
  (a = min(m, n), b = max) at most max(4 a^2 + a b, a^2 + 4 a b) elements
  (`trainer.muon.ns_temporaries`: the Gram matrix, its square and their sums, or the next
  iterate's three terms);
- replicas (> 1 ranks hold the same matrices, HSDP's replicate dim): the all-gather of
  every replica's rows (padded to the largest chunk);
- apply: the stack's results, plus one parameter's result in fp32 when NS's dtype is not.

Under `fsdp_cpu_offload` the states stay in host memory (not counted), Muon's temporaries
do not: its updates are assembled and orthogonalised on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parallelisms.muon_assembly import ns_chunk
from trainer.muon import ns_temporaries


@dataclass
class OptimizerTerms:
    states: int  # persistent bytes: moments and momentum buffers
    step: int  # the step's temporaries, beyond the gradients
    device_step: int  # what of `step` stays on the device under fsdp_cpu_offload (Muon's assembly and NS)
    muon_params: int  # local fp32 bytes of the parameters on Muon (0: AdamW)


def _stack_peak(count: int, local: tuple, glob: tuple, ranks: int, replicas: int, esize: int,
                nesterov: bool) -> int:
    """Peak bytes of one stack of `count` parameters of this layout (module doc: its phases)."""
    lead, a, whole = math.prod(local[:-2]), math.prod(local[-2:]), math.prod(glob[-2:])
    rows = count * lead
    taken = -(-rows // replicas)  # rows this rank's replica takes (the busiest)
    here = -(-taken // ranks)  # whole matrices this rank orthogonalises
    stack = taken * a * esize
    results = (replicas * taken if replicas > 1 else rows) * a * esize  # the all-gather's padded output
    held = here * whole * esize
    one_param = lead * a * 4  # one parameter's fp32 shard
    phases = [stack + (one_param if nesterov else 0),
              held + ns_chunk(here, *glob[-2:], ns_temporaries) * ns_temporaries(*glob[-2:]) * esize,
              results + (one_param if esize != 4 else 0)]
    if ranks > 1:  # in: the stack and the all-to-all's receive buffer, then that and their concatenation;
        phases.append(held + max(stack, held))  # out: the reverse
    if replicas > 1:  # every replica's rows, padded to the largest chunk
        phases.append(stack + replicas * taken * a * esize)
    return max(phases)


def _muon_step(matrices: dict, esize: int, nesterov: bool = True) -> int:
    """Peak bytes of `Muon._muon_step` on these (local shape, global shape, ranks, replicas)
    matrices: its largest stack's."""
    stacks: dict = {}
    worst = 0
    for local, glob, ranks, replicas in matrices.values():
        if ranks == 1 and replicas == 1:  # whole here: a stack of its own
            worst = max(worst, _stack_peak(1, local, glob, 1, 1, esize, nesterov))
        else:
            key = (local, glob, ranks, replicas)
            stacks[key] = stacks.get(key, 0) + 1
    for (local, glob, ranks, replicas), count in stacks.items():
        worst = max(worst, _stack_peak(count, local, glob, ranks, replicas, esize, nesterov))
    return worst


def optimizer_terms(cfg, matrices: dict, param_bytes: int, device: str, impl: str) -> OptimizerTerms:
    """The terms of the busiest rank: `matrices` and `param_bytes` from its `RankParams`."""
    opt = cfg.optimizer
    foreach = impl == "foreach"
    if opt.name != "muon":
        return OptimizerTerms(2 * param_bytes, param_bytes if foreach else 0, 0, 0)
    from trainer.muon import is_muon_param

    meta = {name: torch.empty(v[1], device="meta") for name, v in matrices.items()}
    muon = {n: v for n, v in matrices.items() if is_muon_param(n, meta[n], opt.muon_params, opt.muon_exclude)}
    muon_bytes = sum(math.prod(v[0]) for v in muon.values()) * 4
    dtype = {"bfloat16": 2, "float32": 4}.get(opt.muon_ns_dtype, 2 if device == "cuda" else 4)
    muon_step = _muon_step(muon, dtype, opt.muon_nesterov)
    adamw = param_bytes - muon_bytes
    return OptimizerTerms(2 * adamw + muon_bytes, max(muon_step, adamw if foreach else 0), muon_step, muon_bytes)
