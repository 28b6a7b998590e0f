"""Attention sections: MLA under flash attention, and flex attention with the two masks the
trainer builds for it (a CP chunk's lower-right causal mask, packed documents' block-causal
mask), each forward + backward against SDPA's math kernel in fp32 (TF32 matmuls) with the
equivalent dense mask.

Flex runs as the trainer runs it on CUDA: compiled CP attention traces `attend_prefix`
into flex with `lower_right_block_mask`; document masking calls the compiled flex kernel
with `DocumentMask`'s BlockMask. With --dry (CPU, where flex has no backward in torch
2.13) the same BlockMasks go through eager flex attention, forward only.
"""

from __future__ import annotations

import time

from gpu_check.common import device, generator, randn, reason, sync, tf32

import torch
import torch.nn.functional as F


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _leaves(dev, gen, dtype, shapes, grad: bool) -> list[torch.Tensor]:
    return [randn(*s, dev=dev, gen=gen, dtype=dtype).requires_grad_(grad) for s in shapes]


def _math_reference(q, k, v, mask: torch.Tensor, scale: float | None, grad: bool):
    """SDPA's math kernel in fp32 with a dense bool mask [.., Sq, Sk]: output, and with `grad`
    the grads of (q, k, v) for the loss sum(out^2)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().float().requires_grad_(grad) for t in (q, k, v)]
    with tf32(), sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        if grad:
            out.square().sum().backward()
    return out.detach(), [t.grad for t in leaves] if grad else []


# bf16 kernels against fp32 math: the output within 2e-2 relative, the gradients (through a bf16
# dO and recomputed bf16 scores) within 5e-2; a wrong mask, scale or padding is off by O(1).
TOL_OUT, TOL_GRAD = 2e-2, 5e-2


def _verdict(out, grads, ref, ref_grads) -> str:
    fwd = _rel(out, ref)
    worst = max((_rel(a, b) for a, b in zip(grads, ref_grads)), default=0.0)
    ok = fwd < TOL_OUT and worst < TOL_GRAD
    what = f"out rel {fwd:.1e}" + (f", grads (q, k, v) rel <= {worst:.1e}" if grads else ", forward only")
    return f"{'ok' if ok else 'MISMATCH'}: {what}"


def run_mla_flash(rows, dry: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.common.attention import SDPA

    dev = device(dry)
    b, heads, s, dqk, dv = (1, 2, 64, 24, 16) if dry else (1, 16, 4096, 192, 128)
    dtype = torch.float32 if dry else torch.bfloat16
    q, k, v = _leaves(dev, generator(dev), dtype, ((b, heads, s, dqk), (b, heads, s, dqk), (b, heads, s, dv)), True)
    attn = SDPA(scale=dqk ** -0.5)
    config = f"q/k head {dqk}, v {dv} (padded), {heads} heads, seq {s}"
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = attn(q, k, v)
            out.float().square().sum().backward()
    except RuntimeError as e:
        rows.emit({"config": config, "result": f"FAILED: flash does not apply: {reason(e)}"})
        return
    causal = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
    ref, ref_grads = _math_reference(q, k, v, causal, dqk ** -0.5, grad=True)
    verdict = _verdict(out, [q.grad, k.grad, v.grad], ref, ref_grads)
    rows.emit({"config": config, "result": f"{verdict} vs fp32 math; flash applies, out {tuple(out.shape)}"})


def _flex_case(rows, dev, dry: bool, config: str, shapes, mask: torch.Tensor, run_cuda, block_mask_cpu) -> None:
    """One flex row: `run_cuda(q, k, v)` (the trainer's compiled path) forward + backward on
    CUDA; with --dry, eager flex attention with `block_mask_cpu()`, forward only."""
    dtype = torch.float32 if dry else torch.bfloat16
    grad = dev.type == "cuda"
    q, k, v = _leaves(dev, generator(dev), dtype, shapes, grad)
    rows.progress(config, "compile + forward + backward" if grad else "forward (eager, CPU)")
    t0 = time.perf_counter()
    try:
        if grad:
            out = run_cuda(q, k, v)
            out.float().square().sum().backward()
            grads = [q.grad, k.grad, v.grad]
        else:
            from torch.nn.attention.flex_attention import flex_attention

            out = flex_attention(q, k, v, block_mask=block_mask_cpu(), enable_gqa=q.shape[1] != k.shape[1])
            grads = []
        sync(dev)
        first = time.perf_counter() - t0
        rows.progress(config, "fp32 math reference")
        ref, ref_grads = _math_reference(q, k, v, mask, None, grad)
    except Exception as e:  # noqa: BLE001
        rows.emit({"config": config, "result": f"FAILED during {rows.phase}: {reason(e)}"})
        return
    rows.emit({"config": config, "result": f"{_verdict(out, grads, ref, ref_grads)} vs fp32 math with the "
                                           f"dense mask; first call {first:.1f} s"})


def _document_ids(seq: int, dev) -> torch.Tensor:
    """[1, seq] ids of packed documents of uneven lengths (none a multiple of 128, so that
    tiles hold document boundaries; one document longer than a tile)."""
    lengths, left = [], seq
    for n in (seq // 3 + 5, 37, seq // 4 + 1, 200):
        n = min(n, left)
        if n:
            lengths.append(n)
        left -= n
    if left:
        lengths.append(left)
    return torch.repeat_interleave(torch.arange(len(lengths), device=dev),
                                   torch.tensor(lengths, device=dev), output_size=seq)[None]


def run_flex(rows, dry: bool) -> None:
    from models.common.attention import SDPA, DocumentMask, _block_causal_dense
    from parallelisms.context_parallel import attend_prefix, lower_right_block_mask

    from torch.nn.attention.flex_attention import BlockMask  # noqa: F401 - loaded before dynamo traces its imports

    dev = device(dry)
    h, kv, d = (4, 2, 16) if dry else (32, 8, 128)  # Llama 3 8B's GQA
    # A CP chunk: a query chunk over the prefix that ends with it (a head-tail layout's second chunk).
    q_len, k_len = (128, 384) if dry else (2048, 6144)
    torch._dynamo.reset()
    prefix = torch.compile(attend_prefix, fullgraph=True)  # compiled CP: flex with lower_right_block_mask
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=dev).tril(k_len - q_len)
    _flex_case(rows, dev, dry, f"lower-right causal (CP chunk): q {q_len} over k {k_len}, GQA {h}/{kv}, head {d}",
               ((1, h, q_len, d), (1, kv, k_len, d), (1, kv, k_len, d)), visible,
               lambda q, k, v: prefix(q, k, v, None), lambda: lower_right_block_mask(q_len, k_len, dev))
    seq = 384 if dry else 4096
    doc = _document_ids(seq, dev)
    attn = SDPA()
    n_docs = int(doc.max()) + 1
    _flex_case(rows, dev, dry, f"document mask: {n_docs} packed documents in {seq}, GQA {h}/{kv}, head {d}",
               ((1, h, seq, d), (1, kv, seq, d), (1, kv, seq, d)), _block_causal_dense(doc),
               lambda q, k, v: attn(q, k, v, mask=DocumentMask(doc)), lambda: DocumentMask(doc, backend="flex").block)
