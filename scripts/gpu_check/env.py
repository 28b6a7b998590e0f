"""The `env` section (first, ~15 s): what the machine is, so every later row can be read.

Versions (torch, CUDA, driver, triton, torchao), the device and its compute capability, which
optional packages import, whether a trivial `torch.compile` works (inductor needs a C compiler
and Python.h: Triton builds its launcher with them on CUDA, the C++ backend on CPU), and which
SDPA kernel `torch._fused_sdp_choice` picks for the attention shapes the models run. A row
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

from gpu_check.common import device, reason, sync
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


def sdpa_shapes(dry: bool) -> list[tuple[str, tuple, tuple, tuple, bool, bool]]:
    """(name, q, k, v shapes, is_causal, dense bool mask): Llama 3 8B GQA, DeepSeek 16B MLA
    (v padded 128 -> 192, as models.common.attention does), and CP (a local query chunk over a
    longer prefix; compiled CP builds a dense bool mask)."""
    s = 64 if dry else 1024
    h, kv, d = (4, 2, 16) if dry else (32, 8, 128)
    mh, dqk = (2, 24) if dry else (16, 192)
    return [("GQA (Llama 3 8B)", (1, h, s, d), (1, kv, s, d), (1, kv, s, d), True, False),
            ("MLA (q/k 192, v 128 padded to 192)", (1, mh, s, dqk), (1, mh, s, dqk), (1, mh, s, dqk), True, False),
            ("CP chunk, causal, no mask", (1, h, s // 4, d), (1, kv, s, d), (1, kv, s, d), False, False),
            ("CP chunk, dense bool mask (compiled CP)", (1, h, s // 4, d), (1, kv, s, d), (1, kv, s, d), False, True)]


def _sdp_choice(dev, dtype, q_shape, k_shape, v_shape, causal: bool, masked: bool) -> tuple[str, str]:
    from torch.nn.attention import SDPBackend

    q, k, v = (torch.zeros(s, device=dev, dtype=dtype) for s in (q_shape, k_shape, v_shape))
    mask = torch.ones(q_shape[2], k_shape[2], dtype=torch.bool, device=dev).tril(k_shape[2] - q_shape[2]) \
        if masked else None
    gqa = q_shape[1] != k_shape[1]
    try:
        choice = torch._fused_sdp_choice(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=causal and not masked,
                                         enable_gqa=gqa)
    except Exception as e:  # noqa: BLE001
        return "n/a", f"torch._fused_sdp_choice: {reason(e)}"
    name = next((n for n, b in SDPBackend.__members__.items() if int(b.value) == int(choice)), str(choice))
    slow = name == "MATH" and dev.type == "cuda"
    return "ok", name + (" (the math fallback: slow, and [B,H,q,k] scores in memory)" if slow else "")


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
    env.add("trivial torch.compile", *_trivial_compile(dev, have_compiler))
    dtype = torch.float32 if dry else torch.bfloat16
    for name, q, k, v, causal, masked in sdpa_shapes(dry):
        env.add(f"SDPA choice: {name}", *_sdp_choice(dev, dtype, q, k, v, causal, masked))
