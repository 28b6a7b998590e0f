"""Expert parallelism (EP): routed experts split over ranks, tokens moved by all-to-all.

Layout
------
With `parallelism.expert_parallel_degree = ep`, every MoE layer's routed experts
(`GroupedExperts.w1/w2/w3`, expert dim 0) become DTensors `Shard(0)` on the "ep" mesh:
EP rank r holds experts [r*E/ep, (r+1)*E/ep). The ep ranks are borrowed from
dp_shard x cp x tp (see `ParallelDims._build_expert_meshes`: TP ranks first, then CP, then
dp_shard ranks). The remaining dp_shard x cp x tp / ep ranks ("efsdp") see other tokens for the same
experts: `parallelisms/fsdp.py` FSDP-shards the experts over that mesh (with
dp_replicate for HSDP), before it shards the block over the usual dense mesh. When
dp_shard x cp x tp == ep there is no "efsdp" mesh and the experts are left out of FSDP: the
all-to-all has already gathered every token that touches them.

Token flow (one MoE layer, forward; `ExpertParallelDispatcher.__call__`)
-----------------------------------------------------------------------
`MoE.permute` sorts this rank's routed rows by global expert id, with counts
`num_tokens_per_expert` [E]. Then:

1. counts exchange: all-to-all of the counts, E/ep per peer -> `recv` [ep, E/ep], the rows
   each peer will send for each of our local experts;
2. dispatch: `all_to_all_single_autograd` of the rows, split by the per-peer sums
   (uneven, possibly zero); its backward is the reverse all-to-all;
3. regroup: received rows are ordered (peer, local expert); a stable sort puts them in
   (local expert, peer) order for the grouped GEMM;
4. the local experts run (`experts(rows, recv.sum(0))`; an FSDP-wrapped experts module
   gathers its "efsdp" shards here);
5. un-regroup, then combine: the reverse all-to-all returns every row to the rank
   and the position it came from. `MoE.unpermute` applies the routing weights, which
   never leave their rank.

A rank that receives no rows runs its experts on one zero padding row, so that its
expert gradients exist (as zeros) and every collective of the backward (the reverse
all-to-alls, FSDP's reduce-scatter) runs on every rank.

With TP
-------
EP x TP needs sequence parallel: the MoE then runs on each TP rank's own sequence
shard (see models/deepseek_v3/parallelize.py), so the ep ranks borrowed from TP route
different tokens, as data ranks do. Without SP the TP ranks hold the same tokens and
the experts would count them tp times; that layout is refused (`ConfigError`).

Activation checkpointing: the op-level policy saves `_c10d_functional.all_to_all_single`
(counts and rows), so the recompute sends nothing; full AC re-runs the exchange, which
every rank does at the same point of the backward.

Host syncs: one per MoE layer per forward, the `.tolist()` of the split sizes, which the
uneven all-to-all needs on the host. Nothing else reads the device: `repeat_interleave`
gets its output size from those splits. Under op AC the recompute reuses the saved split
list (the `.tolist()` result is kept by the policy), so it reads nothing
(tests/test_cuda_paths.py counts them).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd, wait_tensor
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor


def routed_experts(model_args) -> int:
    """The model's routed experts per MoE layer; 0 for a dense model (no such field, as Llama 3, or
    0, as a dense Qwen3 flavor)."""
    return getattr(model_args, "n_routed_experts", None) or 0


def check_expert_parallel_layout(model_args, *, ep: int, tp: int, sequence_parallel: bool) -> None:
    """Config-time checks of an EP layout (also run by --dry-run)."""
    from configuration.fields import ConfigError

    if ep <= 1 or model_args is None:
        return
    n_experts = routed_experts(model_args)
    if not n_experts:
        raise ConfigError(f"config error: parallelism.expert_parallel_degree: {ep}, but the model has no routed "
                          "experts; set it to 1")
    if n_experts % ep != 0:
        raise ConfigError(f"config error: parallelism.expert_parallel_degree: {ep} does not divide the model's "
                          f"{n_experts} routed experts; use a divisor of {n_experts}")
    if tp > 1 and not sequence_parallel:
        raise ConfigError(f"config error: parallelism.expert_parallel_degree: {ep} with tensor_parallel_degree "
                          f"{tp} needs sequence parallel (TP ranks would send the same tokens twice); set "
                          "--parallelism.enable_sequence_parallel true")


class ExpertParallelDispatcher:
    """`MoE.token_dispatcher` under EP: dispatch -> local experts -> combine (see module doc)."""

    def __init__(self, ep_mesh, num_experts: int):
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        if num_experts % self.ep:
            raise ValueError(f"{num_experts} experts cannot be split over {self.ep} EP ranks")
        self.num_local = num_experts // self.ep
        self.empty_calls = 0  # forwards in which this rank received no row (tests read it)

    def exchange_counts(self, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """[E] counts for every expert -> [ep, E/ep]: row r = rows peer r sends to each local expert."""
        recv = all_to_all_single(num_tokens_per_expert.contiguous(), None, None, self.group)
        if hasattr(recv, "wait"):
            recv = recv.wait()
        return recv.view(self.ep, self.num_local)

    def __call__(self, experts: nn.Module, routed_input: torch.Tensor,
                 num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        ep, n_local = self.ep, self.num_local
        recv = self.exchange_counts(num_tokens_per_expert)
        send_splits = num_tokens_per_expert.view(ep, n_local).sum(dim=1)
        # One device-to-host copy for both split lists.
        splits = torch.cat([send_splits, recv.sum(dim=1)]).tolist()
        send, received_per_peer = splits[:ep], splits[ep:]

        received = self.exchange(routed_input, received_per_peer, send)

        # (peer, local expert) order -> (local expert, peer) order. output_size: without it the
        # kernel reads sum(recv) back to the host (a hidden sync per MoE layer, and again in
        # the AC recompute); the total is already known from the splits.
        local_ids = torch.arange(n_local, device=recv.device).repeat(ep)
        row_expert = torch.repeat_interleave(local_ids, recv.reshape(-1), output_size=sum(received_per_peer))
        order = torch.argsort(row_expert, stable=True)
        rows = received.index_select(0, order)
        local_counts = recv.sum(dim=0)
        n_rows = rows.shape[0]
        if n_rows == 0:
            self.empty_calls += 1
            # Keep the graph through `received` (its backward is a collective) and give the
            # experts one padding row (past sum(local_counts), dropped below).
            rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        out = experts(rows, local_counts)
        if n_rows == 0:
            out = out[:0]
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        back = out.index_select(0, inverse)
        return self.exchange(back, send, received_per_peer)

    def exchange(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        """The uneven all-to-all of `rows` (with autograd), waited here: a plain tensor.

        Left as an AsyncCollectiveTensor, the combine's output would be waited wherever it is
        first used. Under compile that is the compiled resume of `MoE.forward`, whose first
        call (the one that compiles) waits out of the SAC modes' sight and whose later calls
        (the op-AC recompute) wait in sight: the recompute then meets a `wait_tensor` the
        forward never recorded ("invocation index 1 ... not found in storage"). An explicit
        wait is one recorded op in both."""
        return wait_tensor(all_to_all_single_autograd(rows, output_splits, input_splits, self.group))


def _moe_layers(model: nn.Module) -> list[nn.Module]:
    from models.common.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


class LocalExpertWeights:
    """`GroupedExperts.local_weights` for experts whose w1/w2/w3 are DTensors (EP's Shard(0)
    on the expert dim, TP's Replicate; FSDP's gathered weights of such experts are DTensors
    too): the local tensors, which the grouped GEMMs take. `partial_over_replicate`: the TP
    ranks feed their replicated weights different tokens (sequence parallel), so each local
    gradient is a partial sum, marked `Partial` for DTensor to sum. Plain tensors (FSDP
    alone, between its all-gather and reshard) pass through."""

    def __init__(self, partial_over_replicate: bool = False):
        self.partial_over_replicate = partial_over_replicate

    def __call__(self, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not isinstance(weights[0], DTensor):
            return weights
        grad_placements = None
        if self.partial_over_replicate:
            grad_placements = [Partial() if p.is_replicate() else p for p in weights[0].placements]
        return tuple(w.to_local(grad_placements=grad_placements) for w in weights)


def apply_expert_parallel(model: nn.Module, ep_mesh, expert_fsdp_mesh=None) -> int:
    """Shards every MoE layer's routed experts of `model` (one model part, possibly on the
    meta device) over `ep_mesh` (Shard(0) on the expert dim) and installs the dispatcher.
    `expert_fsdp_mesh` (or None) is recorded on the experts module for `apply_fsdp`.
    Returns the number of MoE layers changed."""
    layers = _moe_layers(model)
    for moe in layers:
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            dt = distribute_tensor(param.data if not param.is_meta else param, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        experts._expert_fsdp_mesh = expert_fsdp_mesh  # read by parallelisms/fsdp.py
        experts.local_weights = LocalExpertWeights()
        moe.token_dispatcher = ExpertParallelDispatcher(ep_mesh, moe.num_experts)
    return len(layers)


def expert_parallel_fn(model: nn.Module, dims, parallelism_cfg) -> None:
    """`ModelSpec.expert_parallel_fn(part, ParallelDims, ParallelismConfig)`: runs after TP."""
    from configuration.fields import ConfigError

    ep = dims.ep
    if ep <= 1:
        return
    check_expert_parallel_layout(getattr(model, "args", None), ep=ep, tp=dims.tp,
                                 sequence_parallel=bool(parallelism_cfg.enable_sequence_parallel))
    efsdp = dims.expert_fsdp_mesh()
    if dims.expert_fsdp_degree > 1 and dims.fsdp_mesh() is None:
        raise ConfigError(f"config error: parallelism.expert_parallel_degree: {ep} leaves dp_shard({dims.dp_shard}) x "
                          f"cp({dims.cp}) x tp({dims.tp}) / ep = {dims.expert_fsdp_degree} ranks that see other tokens "
                          "for the same experts, which needs FSDP (data_parallel_shard_degree > 1); use ep = dp_shard "
                          "x cp x tp")
    # A pipeline stage may hold no MoE layer: then there is nothing to shard.
    apply_expert_parallel(model, dims.mesh("ep"), efsdp)
