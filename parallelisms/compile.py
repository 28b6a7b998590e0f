"""Per-block torch.compile.

Order in the trainer: TP -> activation checkpointing -> `apply_compile` -> FSDP. Each
entry of `model.layers` is compiled in place with `nn.Module.compile`, so module
names and state-dict keys do not change (no `_orig_mod.` prefix). When a block is
checkpoint-wrapped, the *wrapper* is compiled: the partitioner then sees the SAC
save/recompute tags. Compiling the block inside the wrapper would turn it into one
opaque compiled region, and op-level SAC would collapse into full recompute.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from trainer.configurable import opt

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


def apply_compile(model: nn.Module, compile_cfg: CompileConfig, ac_cfg) -> None:
    """Compiles every block of `model.layers` in place (the AC wrapper when there is one).

    With `ac_cfg.mode == "memory_budget"` this sets
    `torch._functorch.config.activation_memory_budget = ac_cfg.memory_budget`, a
    process-wide setting read when each block is first compiled (at its first call).
    """
    from parallelisms.activation_checkpoint import _check_cfg

    mode = _check_cfg(ac_cfg, compile_cfg.enable)
    if not compile_cfg.enable:
        return
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        raise TypeError(f"compile needs the blocks in `model.layers`; {type(model).__name__} has none")
    if mode == "memory_budget":
        torch._functorch.config.activation_memory_budget = float(ac_cfg.memory_budget)
    elif mode != "none":
        disable_dynamo_lru_cache()
    blocks = layers.values() if isinstance(layers, nn.ModuleDict) else list(layers)
    for block in blocks:
        block.compile(backend=compile_cfg.backend, fullgraph=compile_cfg.fullgraph)
    logger.info("compiled %d blocks (backend=%s, ac mode=%s)", len(blocks), compile_cfg.backend, mode)
