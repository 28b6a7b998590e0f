"""Per-block torch.compile.

Order in the assembly: float8 -> TP -> EP -> activation checkpointing -> `apply_compile`
-> FSDP. Compilation is in place (`nn.Module.compile`), so module names and state-dict
keys do not change (no `_orig_mod.` prefix).

Dense blocks (and MoE blocks whose whole forward traces as one graph) are compiled whole,
with `fullgraph`. When a block is checkpoint-wrapped, the *wrapper* is compiled: the
partitioner then sees the SAC save/recompute tags. Compiling the block inside the wrapper
would turn it into one opaque compiled region, and op-level SAC would collapse into full
recompute. One exception: a full-AC block under TP is compiled inside its wrapper
(`checkpoint_inside_fails`: torch 2.13 cannot trace that checkpoint); full recompute is what
it does either way.

MoE blocks that cannot be one graph are compiled piece by piece ("woven" around the
expert step, as TorchTitan does for MoE): under EP the dispatcher's split sizes are
data (`.tolist()`, a device-to-host copy) and the all-to-all output has a data-dependent
row count, and the fp32 experts (CPU tests) run a per-expert loop with data-dependent
splits. So:

- every child of the block but the MoE (norms, attention) is compiled with `fullgraph`;
- the MoE's forward (routing, permute, unpermute, shared experts, aux loss) is compiled
  with `fullgraph=False` around `MoE.run_experts`, which is `torch.compiler.disable`d:
  dynamo reports exactly one graph break per MoE layer (the count is in
  docs/performance.md and checked in tests/test_compile_layouts.py);
- the experts' grouped GEMMs (bf16) run a separately compiled `experts_grouped_mm`
  (fullgraph; under EP the row dim is marked dynamic, so a new token count does not
  recompile).

Woven blocks under AC keep the checkpoint wrapper eager around compiled pieces; the SAC
policy then sees the pieces' outputs, not their inner ops (their insides are recomputed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from configuration.fields import opt

logger = logging.getLogger("compile")


@dataclass
class CompileConfig:
    """[compile]: torch.compile each transformer block."""

    enable: bool = opt(False, "Compile each transformer block (wrapped by AC when AC is on).")
    backend: str = opt("inductor", "torch.compile backend (a name torch._dynamo.list_backends knows).",
                       parse=lambda v: known_backend(v))
    fullgraph: bool = opt(True, "Require one graph per block (fail loudly on graph breaks).")


def known_backend(name):
    """`compile.backend` checked at load, not at the first forward: a registered dynamo backend."""
    if not isinstance(name, str) or name in ("inductor", "aot_eager", "eager"):
        return name  # a non-string is reported by the type check
    import difflib

    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        usual = [k for k in known if "TESTING" not in k and "minifier" not in k]
        raise ValueError(f"unknown torch.compile backend {name!r}{hint}; known: {', '.join(usual)}")
    return name


def disable_dynamo_lru_cache() -> bool:
    """Best effort: turn off dynamo's LRU cache of compiled entries, which avoids a known
    recompile failure with SAC + PP + compile. Returns whether it was applied."""
    try:
        torch._C._dynamo.eval_frame._set_lru_cache(False)
        return True
    except Exception:  # noqa: BLE001 - private API; absent on some builds
        logger.warning("could not disable dynamo's LRU cache; continuing")
        return False


def apply_compile(model: nn.Module, compile_cfg: CompileConfig, ac_cfg, *,
                  compute_dtype: torch.dtype | None = None) -> None:
    """Compiles every block of `model.layers` in place (the AC wrapper when there is one).

    `compute_dtype` is the dtype the blocks compute in (FSDP's param dtype, or autocast's):
    a MoE block without EP is compiled whole when its grouped GEMM traces in that dtype
    (bf16), and woven otherwise (see the module doc). None: weave every MoE block.

    With `ac_cfg.mode == "memory_budget"` this sets
    `torch._functorch.config.activation_memory_budget = ac_cfg.memory_budget`, a
    process-wide setting read when each block is first compiled (at its first call); any
    other mode resets it to 1.0 (save all), so that one process can build models in turn.
    """
    mode = ac_cfg.check(compile_cfg.enable)
    if not compile_cfg.enable:
        return
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        raise TypeError(f"compile needs the blocks in `model.layers`; {type(model).__name__} has none")
    torch._functorch.config.activation_memory_budget = \
        float(ac_cfg.memory_budget) if mode == "memory_budget" else 1.0
    if mode not in ("none", "memory_budget"):
        disable_dynamo_lru_cache()
    blocks = layers.values() if isinstance(layers, nn.ModuleDict) else list(layers)
    woven = 0
    for block in blocks:
        moes = moe_layers(block)
        if moes and not all(traces_whole(moe, compute_dtype) for moe in moes):
            compile_woven(block, compile_cfg)
            woven += 1
        elif checkpoint_inside_fails(block):
            block._checkpoint_wrapped_module.compile(backend=compile_cfg.backend, fullgraph=compile_cfg.fullgraph)
        else:
            block.compile(backend=compile_cfg.backend, fullgraph=compile_cfg.fullgraph)
    logger.info("compiled %d blocks, %d of them MoE blocks woven around the expert step (backend=%s, ac mode=%s)",
                len(blocks), woven, compile_cfg.backend, mode)


def checkpoint_inside_fails(block: nn.Module) -> bool:
    """A full-AC wrapper (`full`, `selective`) around a block with DTensor parameters (TP):
    torch 2.13's AOT autograd cannot trace that checkpoint (its recompute of attention over
    DTensors puts a DeviceMesh among the tensors saved for backward, and the first forward
    fails), with inductor and aot_eager alike. Such a block is compiled inside its wrapper
    instead, which then runs eagerly around it, as for woven MoE blocks: the same recompute
    (the compiled forward runs again in backward), the same result. Op-level AC keeps
    attention's output, so its wrapper traces and stays compiled from outside."""
    from torch.distributed.tensor import DTensor

    return getattr(block, "_ac_mode", None) == "full" and any(isinstance(p, DTensor) for p in block.parameters())


def moe_layers(module: nn.Module) -> list:
    from models.common.moe import MoE

    return [m for m in module.modules() if isinstance(m, MoE)]


def traces_whole(moe, compute_dtype: torch.dtype | None) -> bool:
    """Whether `moe`'s forward is one graph: no EP dispatcher, and grouped GEMMs that trace
    (bf16, 16-byte rows) rather than the per-expert loop."""
    from models.common.grouped_gemm import grouped_mm_supported

    if moe.token_dispatcher is not None or not moe.experts.use_grouped_mm or compute_dtype != torch.bfloat16:
        return False
    w = [torch.empty(p.shape[-3:], dtype=compute_dtype, device="meta") for p in moe.experts.weights()]
    return grouped_mm_supported(torch.empty(1, w[0].shape[1], dtype=compute_dtype, device="meta"), *w)


def compile_woven(block: nn.Module, compile_cfg: CompileConfig) -> None:
    """Compiles a MoE block piece by piece around the expert step (see the module doc)."""
    from models.common.moe import MoE

    inner = getattr(block, "_checkpoint_wrapped_module", block)
    for child in inner.children():
        if isinstance(child, MoE):
            compile_moe(child, compile_cfg)
        else:
            child.compile(backend=compile_cfg.backend, fullgraph=compile_cfg.fullgraph)


def compile_moe(moe, compile_cfg: CompileConfig) -> None:
    from models.common.grouped_gemm import experts_grouped_mm

    # An instance attribute shadows the method: dynamo sees a disabled call and breaks there.
    moe.run_experts = torch.compiler.disable(moe.run_experts, recursive=True)
    moe.compile(backend=compile_cfg.backend, fullgraph=False)
    grouped = torch.compile(experts_grouped_mm, backend=compile_cfg.backend, fullgraph=True)
    if moe.token_dispatcher is not None:  # EP: the received row count changes every step
        moe.experts.compiled_grouped_mm = _dynamic_rows(grouped)
    else:
        moe.experts.compiled_grouped_mm = grouped


def _dynamic_rows(fn):
    def call(w1, w2, w3, x, *args):
        torch._dynamo.maybe_mark_dynamic(x, 0)
        return fn(w1, w2, w3, x, *args)

    return call
