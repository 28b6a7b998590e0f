"""Grouped-GEMM kernels of the routed experts (used by `models.common.moe.GroupedExperts`).

Every expert is a SwiGLU MLP; the rows of all experts run as three `torch._grouped_mm`
calls over one buffer whose rows are sorted by expert, split by offsets. CUDA's kernels
want each expert's group aligned (8 rows for bf16, 16 for float8) and empty groups have
been reported to hang the backward, so on CUDA every group is padded to the alignment
(`padded_group_layout`, static size, no host sync); CPU's kernel takes any group sizes.
`experts_loop` is the reference: one matmul per expert, same numerics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: the CPU
    `_grouped_mm` backward fails on expanded (stride-0) gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` applies: the op exists; the dtype is bf16, or fp32 in eager
    mode on CPU (the op's meta kernel, hence torch.compile, and CUDA take bf16 only); and every
    row stride involved (x's, each weight's, the hidden activation's) is a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.dtype != torch.bfloat16 and not (
            x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling()):
        return False
    esz = x.element_size()
    if any(w.dtype != x.dtype for w in weights):
        return False
    sizes = [x.shape[-1]] + [s for w in weights for s in (w.shape[-1], w.shape[-2] * w.shape[-1])]
    return all((s * esz) % 16 == 0 for s in sizes)


# Rows per expert group that the CUDA grouped GEMM kernels want: bf16 needs each group to
# start on a 16-byte boundary of the row index space (8 rows), torchao's float8 grouped GEMM
# needs multiples of 16. CPU kernels take any group size, including empty ones.
GROUP_ALIGN_BF16 = 8
GROUP_ALIGN_FLOAT8 = 16


def grouped_mm_alignment(x: torch.Tensor, float8: bool = False) -> int:
    """The row alignment of expert groups for `x`'s device (0: no padding, on CPU)."""
    if x.device.type != "cuda":
        return 0
    return GROUP_ALIGN_FLOAT8 if float8 else GROUP_ALIGN_BF16


def padded_group_layout(num_tokens_per_expert: torch.Tensor, n_rows: int, align: int):
    """Where each row goes when every expert's group is padded to a multiple of `align`
    rows, and to at least `align` rows (so no group is empty: zero-size groups have been
    reported to hang the CUDA grouped GEMM's backward). No host sync: the padded buffer
    has the static size P = n_rows + E * align + 1, enough for any routing.

    Returns (dest [n_rows] int64: each row's slot; rows past sum(counts) go to the spare
    last slot, src [P] int64: each slot's row, or n_rows for a zero row, offs [E] int32:
    padded group ends). Slots past offs[-1] are outside every group: the GEMM leaves them
    uninitialised, and the spare slot reads a zero row, so rows past the counts get junk
    outputs (dropped by callers) and a zero gradient."""
    counts = num_tokens_per_expert.to(torch.int64)
    num_experts = counts.shape[0]
    size = n_rows + num_experts * align + 1
    padded = torch.clamp_min((counts + align - 1) // align * align, align)
    pad_end = torch.cumsum(padded, dim=0)
    end = torch.cumsum(counts, dim=0)
    rows = torch.arange(n_rows, device=counts.device)
    expert = torch.searchsorted(end, rows, right=True)  # [n_rows]; E for rows past sum(counts)
    valid = expert < num_experts
    e = expert.clamp_max(num_experts - 1)
    slot_in_group = rows - (end - counts)[e]
    dest = torch.where(valid, (pad_end - padded)[e] + slot_in_group, size - 1)
    src = torch.full((size,), n_rows, dtype=torch.int64, device=counts.device)
    src[dest] = rows
    src[size - 1] = n_rows  # the spare slot reads a zero row: rows past the counts get no gradient
    return dest, src, pad_end.to(torch.int32)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, float8: bool) -> torch.Tensor:
    if float8:
        # torchao's float8 rowwise grouped GEMM (CUDA SM90+) reads each expert's [K, N] matrix
        # column-major. `GroupedExperts.store_for_kernel` (float8.moe_grouped_gemm) holds the
        # weights so, and w is a view; a row-major w would be copied here, on every call.
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

        if w.stride(-2) != 1:
            w = w.mT.contiguous().mT
        return _to_fp8_rowwise_then_scaled_grouped_mm(x, w, offs, out_dtype=x.dtype,
                                                      pad_token_groups_for_grouped_mm=False)
    return torch._grouped_mm(x, w, offs=offs)


def experts_grouped_mm(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
                       num_tokens_per_expert: torch.Tensor, align: int = 0, float8: bool = False) -> torch.Tensor:
    """SwiGLU experts via `torch._grouped_mm`. x: [T, D] rows sorted by expert. Rows past
    sum(num_tokens_per_expert) (padding) are left uninitialised: callers must drop them.

    `align` > 0 pads every expert's group to a multiple of `align` rows (at least `align`)
    with zero rows, as the CUDA kernels need (`grouped_mm_alignment`); the result is the
    same. `float8` runs the GEMMs through torchao's float8 grouped GEMM."""
    x = x.contiguous()
    if align > 0:
        dest, src, offs = padded_group_layout(num_tokens_per_expert, x.shape[0], align)
        x = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, src)  # [P, D], zero rows as padding
    else:
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = F.silu(_grouped_mm(x, w1, offs, float8)) * _grouped_mm(x, w3, offs, float8)
    out = _grouped_mm(h, w2, offs, float8)
    if align > 0:
        out = out.index_select(0, dest)  # [T, D], back to the unpadded rows
    return _ContiguousGrad.apply(out)


def experts_loop(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
                 num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Reference: the same SwiGLU experts one matmul per expert (syncs for the split sizes).
    Padding rows past sum(num_tokens_per_expert) come back as zeros."""
    counts = num_tokens_per_expert.tolist()
    used = sum(counts)
    outs = []
    for e, xe in enumerate(torch.split(x[:used], counts, dim=0)):
        h = F.silu(xe @ w1[e]) * (xe @ w3[e])
        outs.append(h @ w2[e])
    if used < x.shape[0]:
        outs.append(x.new_zeros(x.shape[0] - used, w2.shape[-1]))
    return torch.cat(outs, dim=0)
