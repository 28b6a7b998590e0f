"""Grouped-GEMM sections: the bf16 grouped GEMM (empty experts padded, and inductor with dynamic
rows), torchao's float8 grouped GEMM in the layout the trainer holds its experts in, and the
unpadded diagnostic.

Every tensor is drawn on the device (`common.randn`). Each check compares against the fp32
per-expert loop (in TF32: `common.tf32`), computed once per case and only where a check
reads it, and times forward + backward synchronised at both ends.
"""

from __future__ import annotations

import statistics
import time

from gpu_check.common import count_syncs, device, generator, randn, reason, sync, tf32, timed

import torch


def _expert_shape(dry: bool) -> tuple[int, int, int]:
    """(experts, dim, hidden): DeepSeek 16B's routed experts (tiny with --dry)."""
    return (8, 64, 128) if dry else (64, 2048, 1408)


def _weights(dev, dry: bool, dtype, gen) -> list[torch.Tensor]:
    """w1, w2, w3 as [E, K, N] (x @ w), scaled so the SwiGLU's outputs stay O(1)."""
    e, d, h = _expert_shape(dry)
    return [randn(*s, dev=dev, gen=gen, dtype=dtype, scale=0.05) for s in ((e, d, h), (e, h, d), (e, d, h))]


def _routed_rows(dev, dry: bool, dtype, gen, rows_per_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [T, dim] sorted by expert, counts [E] int64 on `dev`): 2 of every 3 experts empty."""
    e, d, _ = _expert_shape(dry)
    counts = torch.zeros(e, dtype=torch.int64, device=dev)
    counts[::3] = torch.arange(1, len(counts[::3]) + 1, device=dev) * rows_per_expert
    total = rows_per_expert * len(counts[::3]) * (len(counts[::3]) + 1) // 2  # no host read of counts
    return randn(total, d, dev=dev, gen=gen, dtype=dtype), counts


def _reference(ws, x, counts) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The fp32 per-expert loop (TF32 matmuls): output and the grads of (x, w1, w2, w3) for
    the loss sum(y^2)."""
    from models.common.grouped_gemm import experts_loop

    leaves = [t.detach().float().requires_grad_() for t in (x, *ws)]
    with tf32():
        ref = experts_loop(*leaves[1:], leaves[0], counts)
        ref.square().sum().backward()
    return ref.detach(), [t.grad for t in leaves]


def _fwd_bwd(fn, ws, x, n, kernel_layout: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fn(w1, w2, w3, x, n) forward + backward of sum(y^2) on fresh leaves; returns y and the
    grads of (x, w1, w2, w3) as [E, K, N]. `kernel_layout`: the weights are held as the
    trainer holds them for the float8 kernel (`GroupedExperts.store_for_kernel`): [E, N, K]
    contiguous, passed as [E, K, N] column-major views."""
    if kernel_layout:
        w = [t.detach().mT.contiguous().requires_grad_() for t in ws]  # [E, N, K]
        args = [t.mT for t in w]
    else:
        w = args = [t.detach().clone().requires_grad_() for t in ws]
    xi = x.detach().clone().requires_grad_()
    y = fn(*args, xi, n)
    y.float().square().sum().backward()
    return y, [xi.grad, *(t.grad.mT if kernel_layout else t.grad for t in w)]


def _compare(y, grads, ref, ref_grads, counts) -> tuple[float, float, bool]:
    """(forward rel error, worst grad rel error, whether the empty experts' weight grads are zero)."""
    fwd = ((y.float() - ref).norm() / ref.norm()).item()
    grad = max(((a.float() - b).norm() / b.norm()).item() for a, b in zip(grads, ref_grads))
    empty_zero = all(g[counts == 0].abs().max().item() == 0 for g in grads[1:])
    return fwd, grad, empty_zero


def _padded(rows, dev, dry: bool, align: int, label: str) -> None:
    from models.common.grouped_gemm import experts_grouped_mm

    dtype = torch.float32 if dry else torch.bfloat16
    gen = generator(dev)
    ws = _weights(dev, dry, dtype, gen)
    x, counts = _routed_rows(dev, dry, dtype, gen, 3 if dry else 97)
    ref, ref_grads = _reference(ws, x, counts)
    t0 = time.perf_counter()
    y, grads = _fwd_bwd(lambda *a: experts_grouped_mm(*a, align=align), ws, x, counts)
    sync(dev)
    fwd, grad, empty_zero = _compare(y, grads, ref, ref_grads, counts)
    ok = fwd < 2e-2 and grad < 2e-2 and empty_zero
    rows.emit({"config": f"{label}: {len(counts)} experts, {int((counts == 0).sum())} empty, vs the fp32 loop",
               "result": f"{'ok' if ok else 'MISMATCH'}: fwd rel {fwd:.1e}, grad rel {grad:.1e}, empty experts' "
                         f"grads zero: {empty_zero}, {time.perf_counter() - t0:.2f} s"})


def _dynamic_rows(rows, dev, dry: bool) -> None:
    """Inductor (aot_eager with --dry) on the padded bf16 grouped GEMM, rows marked dynamic:
    one graph for every row count, same values as eager, and no host sync in the call."""
    from models.common.grouped_gemm import GROUP_ALIGN_BF16, experts_grouped_mm

    backend = "aot_eager" if dry else "inductor"
    config = f"{backend}, bf16, rows dynamic, padded to {GROUP_ALIGN_BF16}"
    rows.progress(config, "compile")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # What the trainer installs under EP (`parallelisms.compile.compile_moe`): the wrapper marks
    # the rows of the tensor it is called with (marking the caller's x would miss the clone
    # `_fwd_bwd` passes, and dynamo would compile twice, static then automatic-dynamic).
    from parallelisms.compile import _dynamic_rows as rows_marked_dynamic

    fn = rows_marked_dynamic(torch.compile(experts_grouped_mm, backend=backend, fullgraph=True))
    gen = generator(dev)
    ws = _weights(dev, dry, torch.bfloat16, gen)
    worst, syncs, t0 = 0.0, [], time.perf_counter()
    sizes = (1, 2, 3) if dry else (61, 97, 131)
    for per in sizes:
        x, counts = _routed_rows(dev, dry, torch.bfloat16, gen, per)
        ref, ref_grads = _fwd_bwd(lambda *a: experts_grouped_mm(*a, align=GROUP_ALIGN_BF16), ws, x, counts)
        with count_syncs(dev) if dev.type == "cuda" else _no_count() as box:
            y, grads = _fwd_bwd(lambda *a: fn(*a, GROUP_ALIGN_BF16), ws, x, counts)
        syncs.append(box["n"])
        worst = max(worst, ((y.float() - ref.float()).norm() / ref.float().norm()).item(),
                    *(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads, ref_grads)))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ok = worst < 2e-2 and graphs <= 1
    rows.emit({"config": f"{config}: {len(sizes)} row counts", "syncs/step": "/".join(map(str, syncs)),
               "result": f"{'ok' if ok else 'MISMATCH'}: {graphs} graph(s) for {len(sizes)} row counts, rel vs eager "
                         f"{worst:.1e}, {time.perf_counter() - t0:.1f} s"})


class _no_count:
    """CPU: the dispatch counter would turn the compiled frame off; nothing is counted."""

    def __enter__(self):
        return {"n": "n/a"}

    def __exit__(self, *exc):
        return False


def run_grouped_mm(rows, dry: bool) -> None:
    from models.common.grouped_gemm import GROUP_ALIGN_BF16

    dev = device(dry)
    for name, fn in (("padded", lambda: _padded(rows, dev, dry, GROUP_ALIGN_BF16, f"padded to {GROUP_ALIGN_BF16}")),
                     ("dynamic rows", lambda: _dynamic_rows(rows, dev, dry))):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            rows.emit({"config": name, "result": f"FAILED during {rows.phase or name}: {reason(e)}"})


def run_unpadded_groups(rows, dry: bool) -> None:
    _padded(rows, device(dry), dry, 0, "unpadded: empty groups reach the kernel")


def run_float8_grouped_mm(rows, dry: bool) -> None:
    """torchao's float8 rowwise grouped GEMM (CUDA SM90+) with the experts held as the trainer
    holds them under float8.moe_grouped_gemm ([E, N, K], read as column-major [E, K, N]
    views: no copy per call): the first call (Triton autotuning with a cold cache), then warm
    forward + backward against bf16's (the trainer's bf16 layout, [E, K, N] row-major), and
    accuracy vs the fp32 loop. With --dry (or no SM90) the same harness times the bf16 path
    and the row reads n/a."""
    from models.common.grouped_gemm import GROUP_ALIGN_BF16, GROUP_ALIGN_FLOAT8, experts_grouped_mm

    dev = device(dry)
    why = ""
    if dry:
        why = "--dry: float8 grouped GEMMs need CUDA SM90+"
    elif torch.cuda.get_device_capability(dev) < (9, 0):
        why = "float8 grouped GEMMs need compute capability >= 9.0"
    else:
        try:
            import torchao.prototype.moe_training  # noqa: F401
        except Exception as e:  # noqa: BLE001
            why = f"torchao's float8 grouped GEMM does not import: {reason(e)}"
    float8 = not why
    dtype = torch.float32 if dry else torch.bfloat16
    gen = generator(dev)
    ws = _weights(dev, dry, dtype, gen)
    x, counts = _routed_rows(dev, dry, dtype, gen, 3 if dry else 257)
    config = f"{'float8' if float8 else 'bf16 (stand-in)'} vs bf16: {len(counts)} experts, {x.shape[0]} rows, " \
             f"weights [E, N, K]"
    run = lambda f8: _fwd_bwd(lambda *a: experts_grouped_mm(  # noqa: E731
        *a, align=GROUP_ALIGN_FLOAT8 if f8 else GROUP_ALIGN_BF16, float8=f8), ws, x, counts, kernel_layout=f8)
    try:
        rows.progress(config, "first call (autotune, cold cache)")
        cold = timed(lambda: run(float8), dev)
        rows.progress(config, "warm calls")
        warm = statistics.median(timed(lambda: run(float8), dev) for _ in range(3))
        bf16 = statistics.median(timed(lambda: run(False), dev) for _ in range(3))
        with count_syncs(dev) as box:
            y, grads = run(float8)
        rows.progress(config, "fp32 reference")
        ref, ref_grads = _reference(ws, x, counts)
        fwd, grad, empty_zero = _compare(y, grads, ref, ref_grads, counts)
    except Exception as e:  # noqa: BLE001
        rows.emit({"config": config, "result": f"FAILED during {rows.phase}: {reason(e)}"})
        return
    tol = 0.1 if float8 else 2e-2
    verdict = f"n/a: {why} (the harness ran the bf16 path)" if why else \
        ("ok" if fwd < tol and grad < tol and empty_zero else "MISMATCH")
    rows.emit({"config": config, "syncs/step": f"{box['n']} ({box['how']})",
               "result": f"{verdict}: first call {cold:.1f} s, warm fwd+bwd {1e3 * warm:.2f} ms vs bf16 "
                         f"{1e3 * bf16:.2f} ms; fwd rel {fwd:.1e}, grad rel {grad:.1e}, empty experts' grads zero: "
                         f"{empty_zero}"})
