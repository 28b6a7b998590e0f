"""Muon: Newton-Schulz orthogonalised momentum on hidden matrices, AdamW on the rest.

Why one optimizer with two kinds of param groups rather than two optimizers: the loop,
the LR schedule (one LambdaLR scales every group's own base lr), gradient clipping,
the step guard (which simply does not call `step()`) and the checkpoint
(`get_optimizer_state_dict` per model part) all see one plain `torch.optim.Optimizer`.

The rule (`split_params`): a parameter is Muon's when it has >= 2 dims, its name
fnmatches one of `optimizer.muon_params` and none of `optimizer.muon_exclude`; with
the defaults that is every attention and MLP weight of the blocks, and each routed
expert's matrices (a 3-D [E, in, out] tensor is E matrices, orthogonalised one by one);
embeddings, the output head, norms, the router, biases and the MTP modules stay on AdamW.

The update of a Muon matrix W (m x n): buf = mu * buf + g; u = g + mu * buf (Nesterov)
or buf; O = NS5(u), the quintic Newton-Schulz iteration (coefficients 3.4445, -4.7750,
2.0315; singular values pushed into about [0.7, 1.2], not exactly 1); then
W <- W (1 - lr wd) - lr * scale * O, with scale 0.2 sqrt(max(m, n)) ("rms": the update's
RMS matches AdamW's typical 0.2, so AdamW's lr and weight decay carry over, as in
Moonlight) or sqrt(max(1, fan_out / fan_in)) ("spectral", Keller Jordan's).

NS runs in bf16 on GPU and fp32 on CPU (`muon_ns_dtype = "auto"`), on the parameter's
high-precision master copy (float8 training keeps fp32 weights; only the matmuls cast).
Sharded updates are assembled into whole matrices first: parallelisms/muon_assembly.py.
"""

from __future__ import annotations

import fnmatch

import torch
from torch.optim.adamw import adamw
from torch.distributed.tensor import DTensor

from parallelisms.muon_assembly import orthogonalize

NS_COEFFS = (3.4445, -4.7750, 2.0315)
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximate orthogonalisation (U V^T of g = U S V^T) of each matrix of g [..., m, n]
    by the quintic Newton-Schulz iteration, computed in `dtype`; returns g's dtype."""
    a, b, c = NS_COEFFS
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


def ns_temporaries(m: int, n: int) -> int:
    """Elements `newton_schulz` allocates beyond its input for one m x n matrix, at most
    (a = min(m, n), b = max): the Gram matrix, its square and their sum, or the next
    iterate's three terms."""
    a, b = min(m, n), max(m, n)
    return max(4 * a * a + a * b, a * a + 4 * a * b)


def ns_flops(m: int, n: int, steps: int = 5) -> int:
    """FLOPs of `newton_schulz` on one m x n matrix (a = min(m, n), b = max): per iteration
    the Gram matrix (2 a^2 b), its square (2 a^3) and the product with X (2 a^2 b)."""
    a, b = min(m, n), max(m, n)
    return steps * (4 * a * a * b + 2 * a ** 3)


def update_scale(shape: torch.Size, mode: str, rms_factor: float) -> float:
    """Multiplier of the orthogonalised update of one matrix of `shape` (2-D [out, in], or
    3-D grouped experts [E, in, out])."""
    if len(shape) == 3:
        fan_in, fan_out = shape[-2], shape[-1]
    else:
        fan_out, fan_in = shape[-2], shape[-1]
    if mode == "rms":
        return rms_factor * max(fan_out, fan_in) ** 0.5
    return max(1.0, fan_out / fan_in) ** 0.5


def clean_name(name: str) -> str:
    for p in WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def is_muon_param(name: str, param: torch.Tensor, include, exclude) -> bool:
    name = clean_name(name)
    return (param.ndim >= 2 and any(fnmatch.fnmatchcase(name, p) for p in include)
            and not any(fnmatch.fnmatchcase(name, p) for p in exclude))


def split_params(named_params, include, exclude) -> tuple[list, list, list[str]]:
    """(Muon params, AdamW params, Muon param names) of the trainable `named_params`."""
    muon, adamw, names = [], [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        if is_muon_param(name, p, include, exclude):
            muon.append(p)
            names.append(clean_name(name))
        else:
            adamw.append(p)
    return muon, adamw, names


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Muon(torch.optim.Optimizer):
    """Param groups with "muon": True take the Muon update (keys lr, weight_decay, momentum,
    nesterov, ns_steps, scale_mode, rms_factor); the others AdamW's (lr, betas, eps,
    weight_decay), with AdamW's state names (step, exp_avg, exp_avg_sq)."""

    def __init__(self, param_groups: list[dict], *, ns_dtype: torch.dtype = torch.float32, foreach: bool = True,
                 device: torch.device | None = None):
        defaults = dict(lr=1e-3, weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5, scale_mode="rms",
                        rms_factor=0.2, betas=(0.9, 0.95), eps=1e-8, muon=False)
        super().__init__(param_groups, defaults)
        # `device`: where the assembly and NS run (the training device). Under FSDP's CPU offload
        # the parameters, gradients and momentum live in host memory; the updates go there and back.
        self.ns_dtype, self.foreach, self.device = ns_dtype, foreach, device

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon_step if group["muon"] else self._adamw_step)(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]

        def update(i: int) -> torch.Tensor:
            p = params[i]
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            g, buf = _local(p.grad), _local(state["momentum_buffer"])
            buf.mul_(mu).add_(g)  # elementwise: shard-local is exact
            return g.add(buf, alpha=mu) if group["nesterov"] else buf

        def apply(i: int, o: torch.Tensor) -> None:
            p = params[i]
            w = _local(p)
            if wd:
                w.mul_(1.0 - lr * wd)
            w.add_(o.to(w.device, w.dtype), alpha=-lr * update_scale(p.shape, group["scale_mode"], group["rms_factor"]))

        # One stack of updates at a time (built in NS's precision on the training device: bf16
        # halves the assembly bytes), orthogonalised (in chunks of matrices: NS_CHUNK_BOUND)
        # and applied before the next is built.
        ns = lambda x: newton_schulz(x, group["ns_steps"], self.ns_dtype)  # noqa: E731
        orthogonalize(params, update, ns, apply, self.ns_dtype, self.device, ns_temporaries)

    def _adamw_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=self.foreach,
                                amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                                weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
