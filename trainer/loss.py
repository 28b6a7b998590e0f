"""Cross entropy summed over valid tokens; the trainer divides by the global count.

Summing per microbatch and dividing by the number of valid tokens in the whole
global batch (all microbatches, all data-parallel ranks) makes the gradient
independent of how the batch is split, so 1x8 equals 4x2 and 2 ranks equal 1.

Two paths compute the same sum:

- plain (`cross_entropy_sum`): the model's `output` Linear returns the full
  `[tokens, vocab]` logits and `F.cross_entropy` reduces them. Autograd keeps the
  fp32 log-probabilities (`tokens x vocab x 4` bytes) until backward, and backward
  briefly holds two or three more tensors of that size.
- chunked (`loss.chunked_ce = true`, `chunked_linear_cross_entropy`): the output
  projection and the cross entropy run together, `ce_chunk_size` tokens at a time,
  inside one autograd.Function whose backward rebuilds each chunk's logits and
  writes that chunk's slice of grad_hidden and its share of grad_weight. Nothing of
  size `tokens x vocab` exists at any time. See `_ChunkedLinearCE` for the memory.

Under FSDP the output weight is only gathered while the norm+output unit runs, so
the chunked loss is computed *inside* that module: `install_chunked_ce_head`
swaps the model's `output` Linear for a `LinearCrossEntropyHead` holding the same
Parameter (so the state-dict key stays `output.weight`), and
`chunked_ce_labels(model, labels)` hands it the labels for one forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from configuration.fields import opt

IGNORE_INDEX = -100


@dataclass
class LossConfig:
    """[loss]"""

    chunked_ce: bool = opt(False, "Fuse the output projection into a chunked cross entropy that never "
                           "materialises the full [tokens, vocab] logits.")
    ce_chunk_size: int = opt(1024, "Tokens per chunk for chunked_ce.", min=1)
    mtp_weight: float = opt(0.3, "Weight of the multi-token-prediction loss (model.mtp_depth > 0): loss = main + "
                            "mtp_weight / depth * sum of the depths' mean token losses (DeepSeek V3: 0.3, later "
                            "0.1).", min=0.0)

    def validate(self, root) -> None:
        from configuration.fields import ConfigError

        if root.model.mtp_depth >= root.training.seq_len:
            raise ConfigError(f"config error: model.mtp_depth: {root.model.mtp_depth} MTP depths leave no token to "
                              f"predict in sequences of {root.training.seq_len}; use a smaller depth")
        if root.model.mtp_depth > 0 and root.parallelism.context_parallel_degree > 1:
            raise ConfigError("config error: model.mtp_depth: not supported with parallelism.context_parallel_degree "
                              "> 1 (the MTP shift crosses the sequence shards); set --model.mtp_depth 0 or "
                              "--parallelism.context_parallel_degree 1")
        if not self.chunked_ce:
            return
        if root.model.mtp_depth > 0:
            raise ConfigError("config error: loss.chunked_ce: not supported with model.mtp_depth > 0 (the MTP depths "
                              "share the output head); set --loss.chunked_ce false or --model.mtp_depth 0")
        # The TP and PP limits of chunked CE are layout checks: parallelisms/parallel_dims.check_layout.


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token losses, in fp32, ignoring IGNORE_INDEX labels."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def mtp_targets(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """[depth * B, S]: what MTP depth k (1..depth) predicts at position i, labels[i + k]
    (the token k + 1 ahead of input i); the last k positions predict nothing."""
    from models.deepseek_v3.mtp import mtp_targets as targets

    return targets(labels, depth)


def count_tokens(labels: torch.Tensor, mtp_depth: int = 0) -> torch.Tensor:
    """Valid tokens of each loss term of one microbatch: [main, MTP depth 1, ..., depth D]."""
    b = labels.shape[0]
    terms = [labels] + ([mtp_targets(labels, mtp_depth)[k * b:(k + 1) * b] for k in range(mtp_depth)]
                        if mtp_depth else [])
    return torch.stack([(t != IGNORE_INDEX).sum() for t in terms]).to(torch.float32)


class TokenNormalizedLoss:
    """The one training loss: the summed token cross entropy of a microbatch divided by the
    number of valid tokens in the whole global batch.

    Called as `loss_fn(output, labels)` by the trainer and by pipeline schedules alike.
    `output` is the model's logits, or, with chunked CE, the summed loss its head already
    computed. The divisor belongs to one step and is set only for its duration,
    `with loss_fn.normalized_by(global_tokens): ...`, so it can never leak into another step.

    Multi-token prediction (`mtp_depth` D > 0, models/deepseek_v3/mtp.py): the logits are
    [(1 + D) * B, S, V], main head first, and

        loss = CE_0 / N_0 + mtp_weight / D * sum_k CE_k / N_k,

    `global_tokens` then holding N_0..N_D (`count_tokens` per microbatch, summed over the
    global batch), N_k counting the positions depth k can predict. Every returned loss
    carries its detached terms as `loss.token_terms` ([main, depth 1, ..., depth D], each
    divided by its count): summed over a step's losses (a pipeline schedule hands back
    the same tensors, so its shape-inference call does not count) they are what the
    trainer logs: loss (the main head's, what transformers computes) and mtp_loss.
    """

    def __init__(self, chunked_ce: bool = False, mtp_depth: int = 0, mtp_weight: float = 0.0):
        self.chunked_ce, self.mtp_depth, self.mtp_weight = chunked_ce, mtp_depth, mtp_weight
        self._divisor: torch.Tensor | None = None

    @contextlib.contextmanager
    def normalized_by(self, global_tokens: torch.Tensor):
        self._divisor = global_tokens.reshape(-1)
        try:
            yield self
        finally:
            self._divisor = None

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._divisor is None:
            raise RuntimeError("TokenNormalizedLoss called outside normalized_by(global_tokens)")
        if self.mtp_depth == 0:
            loss = _local(output if self.chunked_ce else cross_entropy_sum(output, labels)) / self._divisor[0]
            loss.token_terms = loss.detach().reshape(1)
            return loss
        b = labels.shape[0]
        if output.shape[0] != (1 + self.mtp_depth) * b:
            raise RuntimeError(f"multi-token prediction: expected logits for {1 + self.mtp_depth} x {b} rows, got "
                               f"{output.shape[0]}; the model must be called with mtp_labels")
        targets = torch.cat([labels, mtp_targets(labels, self.mtp_depth)], dim=0)
        terms = torch.stack([_local(cross_entropy_sum(output[k * b:(k + 1) * b], targets[k * b:(k + 1) * b]))
                             for k in range(1 + self.mtp_depth)]) / self._divisor
        loss = terms[0] + (self.mtp_weight / self.mtp_depth) * terms[1:].sum()
        loss.token_terms = terms.detach()
        return loss


def _local(loss_sum: torch.Tensor) -> torch.Tensor:
    """Loss parallel gives a replicated DTensor scalar: its local value is the full loss."""
    return loss_sum.to_local() if hasattr(loss_sum, "to_local") else loss_sum


# ---------------------------------------------------------------------------
# Chunked linear cross entropy
# ---------------------------------------------------------------------------

_MM_OUT_DTYPE_OK: dict[str, bool] = {}


def _accumulate_grad_weight(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """acc[V, D] (fp32) += g[C, V]^T @ h[C, D], rounding the product once, in fp32."""
    if g.dtype == torch.float32:
        acc.addmm_(g.t(), h)
        return
    dev = g.device.type
    if _MM_OUT_DTYPE_OK.get(dev, True):
        try:  # bf16 inputs, fp32 output: no upcast copies of the inputs (CUDA)
            acc.add_(torch.mm(g.t(), h, out_dtype=torch.float32))
            _MM_OUT_DTYPE_OK[dev] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE_OK[dev] = False
    acc.addmm_(g.t().float(), h.float())


class _ChunkedLinearCE(torch.autograd.Function):
    """sum_i CE(hidden[i] @ weight^T, labels[i]) over tokens i, chunk by chunk.

    Shapes: hidden [N, D], weight [V, D], labels [N] (int64). Returns an fp32 scalar.
    Under autocast, hidden and weight are cast to the autocast dtype as F.linear would
    be, in forward and again in backward; gradients come back in the inputs' dtypes.

    Memory (C = chunk tokens, b = bytes per element of hidden's dtype):
      saved for backward: `hidden` and `labels` (N*D*b + N*8; the plain path's Linear
        saves the same `hidden`) and `weight` (a parameter: no extra memory). Nothing
        of size C*V or N*V: the logits are recomputed in backward instead of stored,
        which costs one extra [C, D] x [D, V] matmul per chunk (3 per chunk in
        backward instead of 2).
      forward transient: one chunk's logits C*V*b, their fp32 copy C*V*4 (none when
        b = 4) and fp32 log-probs C*V*4, plus per-token losses N*4.
      backward transient: grad_hidden N*D*b (the output); a grad_weight accumulator
        V*D*4 (fp32 whatever the weight dtype; plus its cast V*D*b at the end when
        b != 4); per chunk the logits C*V*b, their fp32 log-probs C*V*4, the nll
        gradient C*V*4, the logits gradient C*V*4 and its cast C*V*b (none when b = 4).
      So the peak is ~C*V*(12 + 2b) bytes + V*D*4, against ~N*V*12 for the plain path:
      pick `ce_chunk_size` so that the former is small.

    Numerics: each chunk runs the plain path's own kernels (linear, log_softmax, and
    in backward nll_loss's and log_softmax's derivative kernels), and the loss is
    reduced by nll_loss over the picked log-probs in the same order. So the loss and
    grad_hidden are bitwise equal to the plain path whenever the GEMM on a block of C
    rows rounds like the full GEMM (the usual case on CPU; not for C = 1, which takes a
    GEMV path); grad_weight is a sum of per-chunk products, bitwise only with a single
    chunk and otherwise ~1e-7 relative in fp32.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                ignore_index: int) -> torch.Tensor:
        # Under autocast, cast once as autocast would for F.linear, and run the rest
        # with autocast off; backward repeats the same casts (its autograd runs outside
        # the autocast region). Only the compute-dtype copy of hidden is saved.
        dev = hidden.device.type
        cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        ctx.hidden_dtype, ctx.weight_dtype, ctx.cdt = hidden.dtype, weight.dtype, cdt
        with torch.autocast(dev, enabled=False):
            h, w = (hidden.to(cdt), weight.to(cdt)) if cdt is not None else (hidden, weight)
            n = h.shape[0]
            token_loss = torch.empty(n, dtype=torch.float32, device=h.device)
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                logits = F.linear(h[start:end], w)
                token_loss[start:end] = F.cross_entropy(logits.float(), labels[start:end], ignore_index=ignore_index,
                                                        reduction="none")
                del logits
            ctx.save_for_backward(h, weight, labels)
            ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
            # Reduce with nll_loss itself over a [N, 1] matrix of the picked log-probs, so the
            # sum runs in the same order as the plain path's nll_loss over [N, V].
            target = torch.where(labels == ignore_index, ignore_index, 0)
            return F.nll_loss(token_loss.neg_().unsqueeze(1), target, ignore_index=ignore_index, reduction="sum")

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h, weight, labels = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return None, None, None, None, None
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(ctx.cdt) if ctx.cdt is not None else weight
            n, chunk = h.shape[0], ctx.chunk_size
            g = grad_out.detach().to(torch.float32)
            grad_hidden = torch.empty_like(h) if need_h else None
            grad_weight = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                h_c, y_c = h[start:end], labels[start:end]
                logits = F.linear(h_c, w)
                log_probs = torch.log_softmax(logits.float(), dim=-1)
                del logits
                # The same two derivative kernels autograd runs for the plain path: nll_loss's
                # (-g at each valid label, 0 elsewhere), then log_softmax's (which gives
                # g * (softmax - onehot) on valid rows and 0 on ignored ones).
                valid = y_c != ctx.ignore_index
                grad_lp = torch.zeros_like(log_probs)
                grad_lp.scatter_(1, torch.where(valid, y_c, 0).unsqueeze(1),
                                 torch.where(valid, -g, 0.0).to(torch.float32).unsqueeze(1))
                grad = torch.ops.aten._log_softmax_backward_data(grad_lp, log_probs, 1, torch.float32)
                del grad_lp, log_probs
                grad = grad.to(w.dtype)
                if need_h:
                    torch.mm(grad, w, out=grad_hidden[start:end])
                if need_w:
                    _accumulate_grad_weight(grad_weight, grad, h_c)
                del grad
            if need_h and grad_hidden.dtype != ctx.hidden_dtype:
                grad_hidden = grad_hidden.to(ctx.hidden_dtype)
            if need_w and grad_weight.dtype != ctx.weight_dtype:
                grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 chunk_size: int = 1024, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum over tokens of CE(hidden @ weight^T, labels), in fp32, `chunk_size` tokens at a time.

    hidden [..., D]; weight [V, D]; labels [...] (IGNORE_INDEX = skipped). Equals
    `cross_entropy_sum(F.linear(hidden, weight), labels)` (see `_ChunkedLinearCE` for
    how closely) without materialising the [tokens, V] logits in forward or backward.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    return _ChunkedLinearCE.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                  int(chunk_size), int(ignore_index))


class LinearCrossEntropyHead(nn.Linear):
    """The model's output Linear, able to return the summed loss instead of logits.

    It *is* an `nn.Linear` with the same parameters, so installing it keeps the
    state-dict key `output.weight` and lets FSDP treat it exactly as before. Called
    with labels (as `head(hidden, labels)` or through `expect_labels`) it returns
    `chunked_linear_cross_entropy(hidden, weight, labels)`, computed while FSDP has
    the weight gathered; called without, it returns plain logits.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, chunk_size: int = 1024,
                 ignore_index: int = IGNORE_INDEX, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.chunk_size = int(chunk_size)
        self.ignore_index = int(ignore_index)
        self._pending_labels: torch.Tensor | None = None

    @contextlib.contextmanager
    def expect_labels(self, labels: torch.Tensor):
        """The next forward (inside this context) computes the loss against `labels`."""
        self._pending_labels = labels
        try:
            yield
        finally:
            self._pending_labels = None

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            labels, self._pending_labels = self._pending_labels, None
        if labels is None:
            return F.linear(hidden, self.weight, self.bias)
        if self.bias is not None:
            raise NotImplementedError("chunked cross entropy supports output heads without bias")
        return chunked_linear_cross_entropy(hidden, self.weight, labels, self.chunk_size, self.ignore_index)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunked_ce chunk_size={self.chunk_size}"


def install_chunked_ce_head(model: nn.Module, cfg: LossConfig) -> bool:
    """Replaces `model.output` (an nn.Linear) by a `LinearCrossEntropyHead` sharing its
    Parameters, when `cfg.chunked_ce` is on. Call on the (meta) model before any
    parallelism is applied. Returns whether a head is installed."""
    if not cfg.chunked_ce:
        return False
    old = getattr(model, "output", None)
    if isinstance(old, LinearCrossEntropyHead):
        old.chunk_size = int(cfg.ce_chunk_size)
        return True
    if not isinstance(old, nn.Linear):
        raise TypeError(f"loss.chunked_ce needs `model.output` to be an nn.Linear; {type(model).__name__} has "
                        f"{type(old).__name__}")
    head = LinearCrossEntropyHead(old.in_features, old.out_features, bias=old.bias is not None,
                                  chunk_size=cfg.ce_chunk_size, device="meta")
    head.weight = old.weight
    if old.bias is not None:
        head.bias = old.bias
    model.output = head
    return True


def chunked_ce_labels(model: nn.Module, labels: torch.Tensor):
    """Context in which `model`'s `LinearCrossEntropyHead` (if installed) computes the summed
    token loss against `labels` and returns it instead of logits; else a no-op."""
    head = getattr(model, "output", None)
    if isinstance(head, LinearCrossEntropyHead):
        return head.expect_labels(labels)
    return contextlib.nullcontext()


def chunked_ce_loss_sum(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Runs `model(inputs)` with its `LinearCrossEntropyHead` computing the summed token
    loss against `labels` (fp32 scalar); the caller divides by the global token count."""
    if not isinstance(getattr(model, "output", None), LinearCrossEntropyHead):
        raise RuntimeError("chunked_ce_loss_sum: model.output is not a LinearCrossEntropyHead; "
                           "call install_chunked_ce_head before parallelizing the model")
    with chunked_ce_labels(model, labels):
        out = model(inputs)
    if out.dim() != 0:
        raise RuntimeError(f"chunked_ce_loss_sum: the model returned shape {tuple(out.shape)}, not the loss; "
                           "its forward must end with `self.output(h)`")
    return out
