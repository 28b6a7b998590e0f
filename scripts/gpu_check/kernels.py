"""Kernel sections: MLA under flash attention, the bf16 grouped GEMM (empty experts padded, and
inductor with dynamic rows), torchao's float8 grouped GEMM, and the unpadded diagnostic.

Each compares against a reference in fp32 (the per-expert loop, or SDPA's math kernel) and
times forward + backward synchronised at both ends.
"""

from __future__ import annotations

import statistics
import time

from gpu_check.common import count_syncs, device, reason, sync, timed

import torch


def _expert_case(dev, dry: bool, dtype, rows_per_expert: int):
    """The 16B expert shape (64 experts, dim 2048, hidden 1408; tiny with --dry), 2 of 3 experts
    empty: weights, rows sorted by expert, counts, and the fp32 per-expert loop's output and grads."""
    from models.common.grouped_gemm import experts_loop

    e, d, h = (8, 64, 128) if dry else (64, 2048, 1408)
    counts = torch.zeros(e, dtype=torch.int64)
    counts[::3] = torch.arange(1, len(counts[::3]) + 1) * rows_per_expert
    g = torch.Generator(device="cpu").manual_seed(0)
    ws = [(torch.randn(*s, generator=g) * 0.05).to(dev, dtype) for s in ((e, d, h), (e, h, d), (e, d, h))]
    x = torch.randn(int(counts.sum()), d, generator=g).to(dev, dtype)
    ref_ws = [w.detach().float().clone().requires_grad_() for w in ws]
    ref_x = x.detach().float().clone().requires_grad_()
    ref = experts_loop(*ref_ws, ref_x, counts.to(dev))
    ref.square().sum().backward()
    return ws, x, counts, ref, [ref_x, *ref_ws]


def _fwd_bwd(fn, ws, x, n):
    w = [t.detach().clone().requires_grad_() for t in ws]
    xi = x.detach().clone().requires_grad_()
    y = fn(*w, xi, n)
    y.float().square().sum().backward()
    return y, [xi, *w]


def _compare(y, leaves, ref, ref_leaves, counts) -> tuple[float, float, bool]:
    fwd = ((y.float() - ref).norm() / ref.norm()).item()
    grad = max(((a.grad.float() - b.grad).norm() / b.grad.norm()).item() for a, b in zip(leaves, ref_leaves))
    empty_zero = all(t.grad[counts.to(t.device) == 0].abs().max().item() == 0 for t in leaves[1:])
    return fwd, grad, empty_zero


def _padded(rows, dev, dry: bool, align: int, label: str) -> None:
    from models.common.grouped_gemm import experts_grouped_mm

    dtype = torch.float32 if dry else torch.bfloat16
    ws, x, counts, ref, ref_leaves = _expert_case(dev, dry, dtype, 3 if dry else 97)
    n = counts.to(dev)
    t0 = time.perf_counter()
    y, leaves = _fwd_bwd(lambda *a: experts_grouped_mm(*a, align=align), ws, x, n)
    sync(dev)
    fwd, grad, empty_zero = _compare(y, leaves, ref, ref_leaves, counts)
    ok = fwd < 2e-2 and grad < 2e-2 and empty_zero
    rows.emit({"config": f"{label}: {len(counts)} experts, {int((counts == 0).sum())} empty, vs the loop",
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
    worst, syncs, t0 = 0.0, [], time.perf_counter()
    sizes = (1, 2, 3) if dry else (61, 97, 131)
    for per in sizes:
        ws, x, counts, _, _ = _expert_case(dev, dry, torch.bfloat16, per)
        n = counts.to(dev)
        ref, ref_leaves = _fwd_bwd(lambda *a: experts_grouped_mm(*a, align=GROUP_ALIGN_BF16), ws, x, n)
        with count_syncs(dev) if dev.type == "cuda" else _no_count() as box:
            y, leaves = _fwd_bwd(lambda *a: fn(*a, GROUP_ALIGN_BF16), ws, x, n)
        syncs.append(box["n"])
        worst = max(worst, *(((a.grad.float() - b.grad.float()).norm() / b.grad.float().norm()).item()
                             for a, b in zip(leaves, ref_leaves)), ((y.float() - ref.float()).norm() /
                                                                   ref.float().norm()).item())
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
            rows.emit({"config": name, "result": f"FAILED: {reason(e)}"})


def run_unpadded_groups(rows, dry: bool) -> None:
    _padded(rows, device(dry), dry, 0, "unpadded: empty groups reach the kernel")


def run_float8_grouped_mm(rows, dry: bool) -> None:
    """torchao's float8 rowwise grouped GEMM (CUDA SM90+): the first call (Triton autotuning
    with a cold cache), then warm forward + backward against bf16's, and accuracy vs the loop.
    With --dry (or no SM90) the same harness times the bf16 path and the row reads n/a."""
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
    ws, x, counts, ref, ref_leaves = _expert_case(dev, dry, dtype, 3 if dry else 257)
    n = counts.to(dev)
    config = f"{'float8' if float8 else 'bf16 (stand-in)'} vs bf16: {len(counts)} experts, {int(counts.sum())} rows"
    run = lambda f8: _fwd_bwd(lambda *a: experts_grouped_mm(  # noqa: E731
        *a, align=GROUP_ALIGN_FLOAT8 if f8 else GROUP_ALIGN_BF16, float8=f8), ws, x, n)
    try:
        rows.progress(config, "first call (autotune, cold cache)")
        cold = timed(lambda: run(float8), dev)
        rows.progress(config, "warm calls")
        warm = statistics.median(timed(lambda: run(float8), dev) for _ in range(3))
        bf16 = statistics.median(timed(lambda: run(False), dev) for _ in range(3))
        with count_syncs(dev) as box:
            y, leaves = run(float8)
        fwd, grad, empty_zero = _compare(y, leaves, ref, ref_leaves, counts)
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


def run_mla_flash(rows, dry: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.common.attention import SDPA

    dev = device(dry)
    b, heads, s, dqk, dv = (1, 2, 64, 24, 16) if dry else (1, 16, 4096, 192, 128)
    dtype = torch.float32 if dry else torch.bfloat16
    q, k = (torch.randn(b, heads, s, dqk, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(b, heads, s, dv, device=dev, dtype=dtype, requires_grad=True)
    attn = SDPA(scale=dqk ** -0.5)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = attn(q, k, v)
            out.float().square().sum().backward()
        with sdpa_kernel(SDPBackend.MATH):
            ref = attn(q.detach().float(), k.detach().float(), v.detach().float())
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        result = f"{'ok' if rel < 2e-2 else 'MISMATCH'}: flash applies, out {tuple(out.shape)}, rel vs math {rel:.1e}"
    except RuntimeError as e:
        result = f"FAILED: flash does not apply: {reason(e)}"
    rows.emit({"config": f"q/k head {dqk}, v {dv} (padded), {heads} heads, seq {s}", "result": result})
