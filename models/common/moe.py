"""Mixture of experts: token-choice top-k router, grouped routed experts, shared experts.

Reusable by any MoE model. The forward is split into separately overridable steps so
that expert parallelism can be added from outside without touching this file:

    MoE.forward(x [B, S, D])
      route(x_flat)            -> weights [N, K] (fp32), expert ids [N, K], scores [N, E]
      permute(x_flat, ids)     -> routed_input [N*K, D] sorted by expert id (stable),
                                  num_tokens_per_expert [E], order [N*K]
      experts(routed_input, num_tokens_per_expert) -> routed_output [N*K, D] (same order)
      unpermute(routed_output, order, weights)     -> [N, D] (weighted sum over the K picks)
      + shared_experts(x_flat)

An EP implementation wraps `experts.forward` (or `MoE.run_experts`): dispatch the
sorted rows to the ranks that own each contiguous expert range with an all-to-all
split by `num_tokens_per_expert`, run the local experts, and all-to-all the rows back
in the same order. Routing weights never leave the rank: they are applied in
`unpermute`, after the combine.

Load balancing is DeepSeek V3's auxiliary-loss-free scheme: a per-expert bias
(`expert_bias`, a persistent buffer) is added to the scores for expert selection
only; `tokens_per_expert` (a non-persistent buffer) counts the picks during forward,
and `update_moe_load_balance_bias` (models/common/moe_balance.py, with the other
step-level operations) moves the bias toward balance after each optimizer step. An
optional balance loss (coefficient `aux_loss_coeff`) reaches the gradients by itself
through `AddAuxLoss`; the trainer only tells the layers how many sequences one optimizer
step holds (`set_aux_loss_sequences`), so that the loss is one mean over the global
batch whatever the layout (see `AddAuxLoss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common.decoder import FeedForward
from models.common.grouped_gemm import experts_grouped_mm, experts_loop, grouped_mm_alignment, grouped_mm_supported
from models.common.init import trunc_normal_
from models.common.moe_pool import pooled_balance_loss


@dataclass
class MoEArgs:
    num_experts: int = 8
    top_k: int = 2
    num_shared_experts: int = 1
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    # Normalise the top-k weights to sum to 1 (before route_scale). None = only for sigmoid.
    route_norm: bool | None = None
    route_scale: float = 1.0
    # Group-limited routing: experts are split into n_groups equal groups and each token
    # may only pick experts from its best topk_groups groups. n_groups=1 disables it.
    n_groups: int = 1
    topk_groups: int = 1
    aux_loss_coeff: float = 0.0
    # "sequence": DeepSeek V3's per-sequence loss; "batch": the Switch / Qwen3 loss over every
    # token the data ranks route together in one forward (one f_i, P_i per layer: counts summed
    # over the dp mesh by parallelisms/sequence_shards.py), weighted by its sequences' share.
    # Gradient accumulation and pipeline microbatches still each have their own f_i.
    # "model": HF's Qwen3-MoE / Mixtral loss, the batch scope's tokens pooled over every MoE
    # layer of the forward into one loss (models/common/moe_pool.py).
    aux_loss_scope: Literal["sequence", "batch", "model"] = "sequence"
    use_grouped_mm: bool = True


# --------------------------------------------------------------------------- routing


def select_experts(
    scores: torch.Tensor,
    top_k: int,
    *,
    bias: torch.Tensor | None = None,
    n_groups: int = 1,
    topk_groups: int = 1,
    score_func: str = "sigmoid",
) -> torch.Tensor:
    """Expert ids [N, top_k] for scores [N, E] (already softmax-ed / sigmoid-ed).

    `bias` is added for the selection only. With n_groups > 1 a group's score is the
    sum of its two best (biased) scores for sigmoid (DeepSeek V3), its best score for
    softmax; experts outside the `topk_groups` best groups cannot be picked.
    """
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    if n_groups > 1:
        n, e = choice.shape
        grouped = choice.view(n, n_groups, e // n_groups)
        if score_func == "sigmoid" and e // n_groups >= 2:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = group_scores.topk(topk_groups, dim=-1).indices  # [N, topk_groups]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(n, e)
    return choice.topk(top_k, dim=-1).indices


class GateLinear(nn.Linear):
    """The router's [E, D] gate, computed in at least fp32 whatever the activations' dtype (as
    Megatron's `moe_router_dtype=fp32`): bf16 logits have 8 mantissa bits, enough to flip
    top-k choices between near-equal experts. Under FSDP bf16 mixed precision the weight
    arrives bf16-rounded and is upcast; the input, the accumulation and the logits are
    fp32 (fp64 stays fp64). A subclass (not a functional call) so that TP styles keep their
    hooks on it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):  # autocast would run it in bf16 again
            return F.linear(x.to(dtype), self.weight.to(dtype))


class TopKRouter(nn.Module):
    """Token-choice top-k router. `gate` is the only parameter ([E, D] linear, fp32 compute)."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.gate = GateLinear(dim, args.num_experts, bias=False)
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm = args.score_func == "sigmoid" if args.route_norm is None else args.route_norm
        self.route_scale = args.route_scale
        self.n_groups = args.n_groups
        self.topk_groups = args.topk_groups

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None):
        """x: [N, D]. Returns (weights [N, K] fp32, expert ids [N, K] int64, scores [N, E] fp32)."""
        logits = self.gate(x)
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(dim=-1)
        ids = select_experts(scores, self.top_k, bias=expert_bias, n_groups=self.n_groups,
                             topk_groups=self.topk_groups, score_func=self.score_func)
        weights = scores.gather(1, ids)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, ids, scores

    def init_weights(self, std: float) -> None:
        trunc_normal_(self.gate.weight, mean=0.0, std=std)


# --------------------------------------------------------------------------- experts


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked tensors, laid out for x @ W:

        w1: [E, dim, hidden]  (gate projection; HF gate_proj.weight[e] transposed)
        w3: [E, dim, hidden]  (up projection;   HF up_proj.weight[e] transposed)
        w2: [E, hidden, dim]  (down projection; HF down_proj.weight[e] transposed)

    out_e(x) = (silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]. Dim 0 is the expert dim that EP shards.

    `local_weights`: set by a parallel plan that makes w1/w2/w3 distributed tensors (EP, TP;
    `parallelisms.expert_parallel.LocalExpertWeights`): (w1, w2, w3) -> the tensors this rank
    computes with. The grouped GEMMs run on plain tensors; this module knows no layout.
    """

    local_weights = None
    # Set by parallelisms/float8.py (`float8.moe_grouped_gemm`): grouped GEMMs in float8.
    float8_grouped_mm: bool = False
    # Set by `store_for_kernel`: w1/w2/w3 are held as [E, N, K] (see there).
    kernel_layout: bool = False
    # Set by parallelisms/compile.py: a torch.compile'd `experts_grouped_mm` for bf16 inputs.
    compiled_grouped_mm = None

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def store_for_kernel(self) -> None:
        """Holds w1/w2/w3 as [E, N, K], each expert's matrix transposed and contiguous: the
        column-major [E, K, N] that torchao's float8 grouped GEMM reads is then a view
        (`weights()`), where the [E, K, N] row-major layout costs a copy of every expert
        weight on every call, kept for backward. Called before any sharding (the expert dim
        stays dim 0). The state dict keeps [E, K, N] (hooks below), so checkpoints and HF
        exports do not depend on it; init draws the same values."""
        if self.kernel_layout:
            return
        if self.local_weights is not None or any(type(getattr(self, n)) is not nn.Parameter for n in ("w1", "w2", "w3")):
            raise RuntimeError("store_for_kernel must run before the experts are sharded")
        for name in ("w1", "w2", "w3"):
            p = getattr(self, name)
            setattr(self, name, nn.Parameter(p.detach().mT.contiguous(), requires_grad=p.requires_grad))  # [E, N, K]
        self.kernel_layout = True
        self._register_state_dict_hook(_experts_state_dict_external)
        self.register_load_state_dict_pre_hook(_experts_load_state_dict_internal)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) as [E, K, N] for x @ w: the parameters, or their transposed views."""
        ws = (self.w1, self.w2, self.w3)
        return tuple(w.mT for w in ws) if self.kernel_layout else ws

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: [T, dim] rows grouped by expert in order 0..E-1; num_tokens_per_expert: [E] int."""
        w1, w2, w3 = self.w1, self.w2, self.w3
        if self.local_weights is not None:
            w1, w2, w3 = self.local_weights(w1, w2, w3)
        if self.kernel_layout:  # [E, N, K] -> [E, K, N] views, column-major per expert
            w1, w2, w3 = w1.mT, w2.mT, w3.mT
        if torch.is_autocast_enabled(x.device.type):
            # `_grouped_mm` has no autocast rule: without this, bf16 autocast (one GPU, no FSDP)
            # would hand it the fp32 residual stream, and fall back to the per-expert loop.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if w1.dtype != x.dtype:  # weights FSDP's mixed precision does not manage (EP without FSDP)
            w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
        if self.use_grouped_mm and grouped_mm_supported(x, w1, w2, w3):
            # The compiled function takes bf16 only (the op's meta kernel); fp32 stays eager (CPU).
            fn = self.compiled_grouped_mm if self.compiled_grouped_mm is not None and x.dtype == torch.bfloat16 \
                else experts_grouped_mm
            return fn(w1, w2, w3, x, num_tokens_per_expert, grouped_mm_alignment(x, self.float8_grouped_mm),
                      self.float8_grouped_mm)
        return experts_loop(w1, w2, w3, x, num_tokens_per_expert)

    def init_weights(self, std: float, out_std: float) -> None:
        for w, s in zip(self.weights(), (std, out_std, out_std)):
            if not self.kernel_layout:
                trunc_normal_(w, mean=0.0, std=s)
                continue
            # Drawn in the [E, K, N] layout, then stored transposed: the same values as without.
            drawn = torch.empty_like(w, memory_format=torch.contiguous_format)
            trunc_normal_(drawn, mean=0.0, std=s)
            with torch.no_grad():
                w.copy_(drawn)


def _experts_state_dict_external(module, state_dict, prefix, local_metadata):
    """State-dict hook of a `store_for_kernel` GroupedExperts: [E, N, K] -> [E, K, N] views."""
    for name in ("w1", "w2", "w3"):
        if prefix + name in state_dict:
            state_dict[prefix + name] = state_dict[prefix + name].mT
    return state_dict


def _experts_load_state_dict_internal(module, state_dict, prefix, *args):
    """Load pre-hook of a `store_for_kernel` GroupedExperts: [E, K, N] -> its [E, N, K]."""
    for name in ("w1", "w2", "w3"):
        if prefix + name in state_dict:
            state_dict[prefix + name] = state_dict[prefix + name].mT


# --------------------------------------------------------------------------- aux loss


class AddAuxLoss(torch.autograd.Function):
    """Returns x unchanged; in backward, gives `aux_loss` a gradient of 1, as if it had
    been added to the final loss. So the balance loss trains the router with no help
    from the trainer (and works under pipeline parallelism and activation checkpointing).
    Each forward's `aux_loss` must therefore be its share of the global loss: MoE sums
    the loss over its sequences and scales it by `MoE.aux_loss_scale` (1 / sequences per
    optimizer step, set by `set_aux_loss_sequences`), so that gradient accumulation,
    pipeline microbatches and data-parallel ranks all add up to one global mean."""

    @staticmethod
    def forward(ctx, x, aux_loss):
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=g.device)


def sequence_balance_loss(scores: torch.Tensor, ids: torch.Tensor, bsz: int, num_experts: int,
                          score_func: str, *, reduction: str = "mean", count_reduce=None) -> torch.Tensor:
    """DeepSeek V3's sequence-wise balance loss (without alpha): over sequences, the mean
    (or sum) of sum_i f_i * P_i, f_i = E / (K * S) * #tokens of the sequence picking i,
    P_i = mean over the sequence's tokens of the normalised score of i.

    `count_reduce` (context parallel, sequence parallel): each rank holds a slice of every
    sequence. It maps the [B, E] pick counts (no gradient) to (their sum over the ranks
    holding the other slices, the number of slices), so f_i is the whole sequence's, and
    P_i is this rank's partial sum over its tokens / S; summed over the slices (as the
    router's gradient is) the loss and its gradient are those of the whole sequences
    (parallelisms/sequence_shards.py)."""
    n, k = ids.shape
    seq = n // bsz
    probs = scores / scores.sum(dim=-1, keepdim=True) if score_func == "sigmoid" else scores
    picks = torch.zeros(bsz, num_experts, device=ids.device, dtype=probs.dtype)
    picks.scatter_add_(1, ids.view(bsz, seq * k), torch.ones(bsz, seq * k, device=ids.device, dtype=probs.dtype))
    full_seq = seq
    if count_reduce is not None:
        picks, slices = count_reduce(picks)
        full_seq = seq * slices
    p = probs.view(bsz, seq, num_experts).sum(dim=1) / full_seq  # [B, E]
    f = picks * (num_experts / (k * full_seq))
    per_seq = (f * p).sum(dim=-1)
    return per_seq.sum() if reduction == "sum" else per_seq.mean()


# --------------------------------------------------------------------------- MoE layer


class MoE(nn.Module):
    """Routed experts (top-k of E) plus optional always-on shared experts.

    Buffers:
      expert_bias       [E] fp32, persistent (checkpointed): selection-only score bias.
      tokens_per_expert [E] int64, non-persistent: picks of the train-mode forwards since the
                        last bias update (validation runs in eval mode: not counted).
      aux_loss          [] fp32, non-persistent: last forward's share of the balance loss
                        (detached, with its coefficient and normalisation), for logging; 0
                        when aux_loss_coeff is 0.
    """

    def __init__(self, dim: int, hidden_dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.router = TopKRouter(dim, args)
        self.experts = GroupedExperts(dim, hidden_dim, args.num_experts, args.use_grouped_mm)
        self.shared_experts = (FeedForward(dim, hidden_dim * args.num_shared_experts)
                               if args.num_shared_experts > 0 else None)
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("aux_loss", torch.zeros((), dtype=torch.float32), persistent=False)
        # Expert parallelism hook: a callable (experts, routed_input, num_tokens_per_expert)
        # -> routed_output that dispatches rows to the experts' ranks and combines them back
        # (parallelisms/expert_parallel.py). None: run the experts here.
        self.token_dispatcher = None
        # Balance-loss normalisation: 1 / sequences per optimizer step over all ranks (set by
        # the trainer through `set_aux_loss_sequences`); None = the mean over this forward's
        # sequences. `aux_loss_count_reduce`: installed by the CP plan and a sequence-parallel
        # TP plan, whose ranks hold slices of each sequence (see `sequence_balance_loss`).
        self.aux_loss_scale: float | None = None
        self.aux_loss_count_reduce = None

    # ---- steps (each one a seam for EP) ----
    def route(self, x: torch.Tensor):
        return self.router(x, self.expert_bias)

    def permute(self, x: torch.Tensor, ids: torch.Tensor):
        """Rows of x repeated per pick and sorted by expert id (stable: ties keep token order)."""
        flat = ids.reshape(-1)
        num_tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device)
        num_tokens_per_expert.scatter_add_(0, flat, torch.ones_like(flat))
        order = torch.argsort(flat, stable=True)
        routed_input = x.index_select(0, order // ids.shape[1])
        return routed_input, num_tokens_per_expert, order

    def run_experts(self, routed_input: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self.token_dispatcher is not None:
            return self.token_dispatcher(self.experts, routed_input, num_tokens_per_expert)
        return self.experts(routed_input, num_tokens_per_expert)

    def unpermute(self, routed_output: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Back to [N, K, D] pick order (a gather by the inverse permutation, deterministic),
        then the routing-weighted sum over the K picks."""
        n, k = weights.shape
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        picks = routed_output.index_select(0, inverse).view(n, k, -1)
        return torch.bmm(weights.to(picks.dtype).unsqueeze(1), picks).squeeze(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        x_flat = x.reshape(-1, dim)
        weights, ids, scores = self.route(x_flat)
        routed_input, num_tokens_per_expert, order = self.permute(x_flat, ids)
        if self.training:
            # Only train-mode forwards feed the bias update: the validator runs the model in
            # eval mode (trainer/validation.py). Under activation checkpointing the recompute
            # counts again; the update uses only sign(mean - count), which a uniform factor
            # leaves alone.
            with torch.no_grad():
                self.tokens_per_expert.add_(num_tokens_per_expert)
        routed_output = self.run_experts(routed_input, num_tokens_per_expert)
        out = self.unpermute(routed_output, order, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_flat)
        out = out.view(bsz, seqlen, dim)
        if self.args.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            scale = self.aux_loss_scale if self.aux_loss_scale is not None else 1.0 / bsz
            # "batch" treats the forward's tokens as one sequence: [N, K] ids -> 1 x (N * K) picks.
            # Its share is that of every sequence the data ranks route together (the count
            # reduce's batch slices: other data ranks' sequences), as one loss over their batch.
            per_batch = self.args.aux_loss_scope in ("batch", "model")
            batch_seqs = bsz * getattr(self.aux_loss_count_reduce, "batch_slices", 1) if per_batch else 1
            if self.args.aux_loss_scope == "model":  # one loss over every layer: its gradient comes in backward
                probs = scores / scores.sum(dim=-1, keepdim=True) if self.args.score_func == "sigmoid" else scores
                return pooled_balance_loss(out, probs, ids, self.args.aux_loss_coeff * scale * batch_seqs,
                                           self.aux_loss_count_reduce, self.aux_loss)
            aux = (self.args.aux_loss_coeff * scale * batch_seqs) * sequence_balance_loss(
                scores, ids, 1 if per_batch else bsz, self.num_experts, self.args.score_func, reduction="sum",
                count_reduce=self.aux_loss_count_reduce)
            with torch.no_grad():
                self.aux_loss.copy_(aux.detach())
            out = AddAuxLoss.apply(out, aux)
        return out

    def init_weights(self, std: float, out_std: float) -> None:
        self.router.init_weights(std)
        self.experts.init_weights(std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std, out_std)
        with torch.no_grad():
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()
            self.aux_loss.zero_()


# --------------------------------------------------------------------------- model walks


def moe_layers(model: nn.Module | Iterable[nn.Module]) -> list[MoE]:
    """Every MoE layer of `model` (a module, or a list of pipeline model parts), in module order."""
    parts = [model] if isinstance(model, nn.Module) else list(model)
    return [m for part in parts for m in part.modules() if isinstance(m, MoE)]


def inactive_expert_params(model: nn.Module) -> int:
    """Routed-expert parameters a token does not visit, over an unsharded (meta) model:
    (E - top_k) experts' w1, w2, w3 per MoE layer. Total minus this is the activated count."""
    inactive = 0
    for m in moe_layers(model):
        per_expert = sum(w[0].numel() for w in (m.experts.w1, m.experts.w2, m.experts.w3))
        inactive += (m.num_experts - m.top_k) * per_expert
    return inactive
