"""The balance loss pooled over a model's MoE layers (`aux_loss_scope = "model"`): HF's
Qwen3-MoE / Mixtral `load_balancing_loss_func`.

transformers concatenates every MoE layer's router logits of a forward and computes one
Switch loss over them: with L layers of T tokens, R = L T rows,

    loss = E sum_i (C_i / R) (S_i / R),   C_i = picks of expert i over all layers (top-k),
                                          S_i = sum over all layers and tokens of p_i (softmax),

times `router_aux_loss_coef`. That is not a sum of per-layer losses: every layer's router
gradient, E C_i / R^2 per unit of p_i, depends on the picks of all layers. A layer cannot
know them in its forward (later layers have not run), but its backward runs after the whole
forward. So the model's forward opens one `RoutingPool` (`pooled_routing`), each MoE layer
adds its pick counts while it is open, and `PooledBalanceLoss` computes each layer's
gradient in backward from the pool's totals. An activation-checkpoint recompute happens in
backward, when no pool is open, so it adds nothing; each forward (gradient accumulation,
pipeline microbatches) has its own pool. Pipeline stages hold different layers and share no
pool: the config refuses this scope under PP. A layer run outside a model's forward (a
probe, a unit test) pools alone (L = 1).

Pick counts are summed over the ranks holding slices of the same tokens (CP, sequence
parallel, and the data ranks: Qwen's global-batch balance), as for the batch scope; the
probability sums stay this rank's partial sums, which the router's gradient sums again.
"""

from __future__ import annotations

import contextlib

import torch

_open: list["RoutingPool"] = []  # the pool of the model forward in progress (innermost last)


class RoutingPool:
    """One forward's pick counts over every MoE layer, and how many layers added them."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None  # [E] fp32, summed over layers
        self.layers = 0

    def add(self, counts: torch.Tensor) -> None:
        self.counts = counts if self.counts is None else self.counts + counts
        self.layers += 1


@contextlib.contextmanager
def pooled_routing():
    """Around a model's forward: its MoE layers with scope "model" pool their routing here."""
    _open.append(RoutingPool())
    try:
        yield
    finally:
        _open.pop()


def current_pool() -> RoutingPool | None:
    return _open[-1] if _open else None


class PooledBalanceLoss(torch.autograd.Function):
    """Returns x unchanged; in backward gives `prob_sums` (this layer's [E] sums of p_i over
    its tokens) the pooled loss's gradient, `weight` x E x C / R^2 with R = pool.layers x
    `rows` (the forward's tokens per layer, all slices), and writes this layer's share of the
    loss, `weight` x E x C . prob_sums / R^2, into `logged` (the layer's aux_loss buffer)."""

    @staticmethod
    def forward(ctx, x, prob_sums, pool: RoutingPool, weight: float, rows: int, logged: torch.Tensor):
        ctx.pool, ctx.weight, ctx.rows, ctx.logged = pool, weight, rows, logged
        ctx.prob_sums = prob_sums.detach()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        pool = ctx.pool
        total = pool.layers * ctx.rows
        grad = pool.counts.to(ctx.prob_sums.dtype) * (ctx.weight * pool.counts.numel() / total ** 2)
        with torch.no_grad():
            ctx.logged.copy_((grad * ctx.prob_sums).sum())
        return g, grad, None, None, None, None


@torch.compiler.disable  # eager: its backward reads the pool at backward time, which a traced graph would bake in
def pooled_balance_loss(out: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, weight: float,
                        count_reduce, logged: torch.Tensor) -> torch.Tensor:
    """`out` with the pooled loss attached: probs [N, E] (normalised scores), ids [N, K] picks."""
    n, k = ids.shape
    picks = torch.zeros(1, probs.shape[-1], device=ids.device, dtype=torch.float32)
    picks.scatter_add_(1, ids.reshape(1, n * k), torch.ones(1, n * k, device=ids.device, dtype=torch.float32))
    slices = 1
    if count_reduce is not None:
        picks, slices = count_reduce(picks)
    pool = current_pool()
    if pool is None:  # outside a model's forward, or an activation-checkpoint recompute (its pool has closed)
        pool = RoutingPool()
    pool.add(picks.reshape(-1).detach())
    return PooledBalanceLoss.apply(out, probs.sum(dim=0), pool, weight, n * slices, logged)
