"""The `env` section (first, ~30 s cold): what the machine is, so every later row can be read.

Versions (torch, CUDA, driver, triton, torchao), the device and its compute capability, which
optional packages import, whether a trivial `torch.compile` works (inductor needs a C compiler
and Python.h: Triton builds its launcher with them on CUDA, the C++ backend on CPU), which
SDPA kernel the trainer's attention calls get (inputs requiring grad, as in training: the
choice depends on it) and whether they run forward + backward. A row
that depends on something missing reads `n/a: <why>`, not FAILED. Written to env.json and
env.md in the results folder, and as rows of the table.
"""

from __future__ import annotations

import importlib
import platform
import shutil
import subprocess
import sysconfig
import time
from pathlib import Path

from gpu_check.common import device, generator, randn, reason, sync
from gpu_check.rows import write_json

import torch


def _version(module: str) -> tuple[str, str]:
    try:
        return "ok", str(getattr(importlib.import_module(module), "__version__", "imported (no __version__)"))
    except Exception as e:  # noqa: BLE001 - a package that does not import is a row, not the end of the section
        return "n/a", f"does not import: {reason(e)}"


def _driver() -> tuple[str, str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "n/a", "nvidia-smi not on PATH"
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip().splitlines()
        return ("ok", out[0]) if out else ("n/a", "nvidia-smi printed nothing")
    except (OSError, subprocess.TimeoutExpired) as e:
        return "n/a", f"nvidia-smi: {reason(e)}"


def _compiler() -> tuple[str, str]:
    cc = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    missing = [what for what, ok in (("a C compiler (cc/gcc/clang)", cc), (f"{header}", header.exists())) if not ok]
    if missing:
        return "n/a", f"missing {' and '.join(missing)}: torch.compile (inductor) cannot build kernels"
    return "ok", f"{shutil.which(cc)}, {header}"


def _trivial_compile(dev: torch.device, have_compiler: bool) -> tuple[str, str]:
    if not have_compiler:
        return "n/a", "no C compiler / Python.h (see the row above)"
    torch._dynamo.reset()
    # --dry: aot_eager (dynamo + AOT, no code generated): a cold CPU inductor build of the
    # C++ kernels costs about a minute on 2 cores and is not what the GPU run compiles.
    backend = "aot_eager" if dev.type == "cpu" else "inductor"
    t0 = time.perf_counter()
    try:
        fn = torch.compile(lambda x: (x * 2 + 1).sin(), backend=backend)
        x = torch.arange(8.0, device=dev)
        ok = torch.allclose(fn(x), (x * 2 + 1).sin())
        sync(dev)
    except Exception as e:  # noqa: BLE001
        return "FAILED", reason(e)
    return ("ok" if ok else "MISMATCH"), f"{backend}, {time.perf_counter() - t0:.1f} s cold"


def sdpa_shapes(dry: bool) -> list[tuple[str, tuple, tuple, tuple, str]]:
    """(name, q, k, v shapes, kind) of the attention calls the trainer makes: Llama 3 8B GQA,
    DeepSeek 16B MLA (v padded 128 -> 192, as models.common.attention does), both causal; a CP
    chunk (a local query chunk over a longer prefix: `attend_prefix`'s lower-right causal
    mask); and SDPA with a dense bool mask (what compiled CP runs on CPU)."""
    s = 64 if dry else 1024
    h, kv, d = (4, 2, 16) if dry else (32, 8, 128)
    mh, dqk = (2, 24) if dry else (16, 192)
    return [("GQA (Llama 3 8B)", (1, h, s, d), (1, kv, s, d), (1, kv, s, d), "causal"),
            ("MLA (q/k 192, v 128 padded to 192)", (1, mh, s, dqk), (1, mh, s, dqk), (1, mh, s, dqk), "causal"),
            ("CP chunk, lower-right causal (eager CP)", (1, h, s // 4, d), (1, kv, s, d), (1, kv, s, d), "lower_right"),
            ("CP chunk, dense bool mask (compiled CP on CPU)", (1, h, s // 4, d), (1, kv, s, d), (1, kv, s, d),
             "bool_mask")]


def _backend_name(choice) -> str:
    from torch.nn.attention import SDPBackend

    return next((n for n, b in SDPBackend.__members__.items() if int(b.value) == int(choice)), str(choice))


def _lower_right_choice(q, k, v, gqa: bool) -> str:
    """The kernel `CausalBias` (what `lower_right_mask` gives on CUDA) dispatches to: flash,
    else memory-efficient, else SDPA on the materialised mask (torch/nn/attention/bias.py)."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    params = SDPAParams(q, k, v, None, 0.0, False, gqa)
    if can_use_flash_attention(params):
        return "FLASH_ATTENTION"
    if can_use_efficient_attention(params):
        return "EFFICIENT_ATTENTION"
    return "MATH (the mask materialised: slow, and [B,H,q,k] scores in memory)"


def _sdpa_row(dev, dtype, q_shape, k_shape, v_shape, kind: str) -> tuple[str, str]:
    """The kernel SDPA picks for the trainer's call, with inputs that require grad (the
    choice depends on it), and that call run forward + backward."""
    from models.common.attention import SDPA
    from parallelisms.context_parallel import attend_prefix, lower_right_mask

    gen = generator(dev)
    q, k, v = (randn(*s, dev=dev, gen=gen, dtype=dtype).requires_grad_() for s in (q_shape, k_shape, v_shape))
    gqa = q_shape[1] != k_shape[1]
    mask = torch.ones(q_shape[2], k_shape[2], dtype=torch.bool, device=dev).tril(k_shape[2] - q_shape[2])
    try:
        if kind == "lower_right" and dev.type == "cuda":
            name = _lower_right_choice(q, k, v, gqa)
        else:
            attn_mask = {"causal": None, "bool_mask": mask,
                         "lower_right": lower_right_mask(q_shape[2], k_shape[2], dtype, dev)}[kind]
            name = _backend_name(torch._fused_sdp_choice(q, k, v, attn_mask=attn_mask, dropout_p=0.0,
                                                         is_causal=kind == "causal", enable_gqa=gqa))
    except Exception as e:  # noqa: BLE001
        return "n/a", f"the kernel choice: {reason(e)}"
    slow = name == "MATH" and dev.type == "cuda"
    name += " (the math fallback: slow, and [B,H,q,k] scores in memory)" if slow else ""
    try:
        if kind == "causal":
            out = SDPA()(q, k, v)
        elif kind == "lower_right":
            out = attend_prefix(q, k, v, None)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        out.float().square().sum().backward()
        sync(dev)
    except Exception as e:  # noqa: BLE001
        return "FAILED", f"{name}; forward + backward: {reason(e)}"
    return "ok", f"{name}; forward + backward ran"


class _Report:
    """env.json / env.md and the table's env rows, rewritten after every item (a section cut
    off halfway still leaves what it found)."""

    def __init__(self, rows, out: Path):
        self.rows, self.out = rows, out
        self.data: dict[str, str] = {"torch": torch.__version__}
        self.lines: list[str] = []

    def add(self, what: str, verdict: str, detail: str) -> str:
        self.data[what] = detail if verdict == "ok" else f"{verdict}: {detail}"
        self.lines.append(f"- {what}: {verdict}: {detail}")
        self.rows.emit({"config": what, "result": f"{verdict}: {detail}"})
        write_json(self.out / "env.json", self.data)
        (self.out / "env.md").write_text(f"# gpu_check env: {self.data.get('device', '?')}\n\n" +
                                         "\n".join(self.lines) + "\n")
        return verdict


def run(rows, dry: bool, out: Path) -> None:
    dev = device(dry)
    env = _Report(rows, out)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        cap = torch.cuda.get_device_capability(dev)
        env.data["device"] = f"{props.name} (sm {cap[0]}.{cap[1]}, {props.total_memory / 2**30:.0f} GiB)"
        env.add("device", "ok", env.data["device"])
        env.add("compute capability", "ok", f"{cap[0]}.{cap[1]}")
        env.add("CUDA (torch build)", "ok", str(torch.version.cuda))
        env.add("driver", *_driver())
    else:
        env.data["device"] = f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
        env.add("device", "ok", env.data["device"])
        env.add("CUDA", "n/a", "--dry: a CPU run" if dry else "no CUDA device")
    env.add("python", "ok", platform.python_version())
    env.add("torch", "ok", torch.__version__)
    for module in ("triton", "torchao", "tiktoken", "tokenizers"):
        env.add(f"import {module}", *_version(module))
    have_compiler = env.add("C compiler + Python.h", *_compiler()) == "ok"
    # The SDPA rows first: seconds, where the first inductor compile below may take a minute.
    dtype = torch.float32 if dry else torch.bfloat16
    for name, q, k, v, kind in sdpa_shapes(dry):
        env.add(f"SDPA: {name}", *_sdpa_row(dev, dtype, q, k, v, kind))
    env.add("trivial torch.compile", *_trivial_compile(dev, have_compiler))
