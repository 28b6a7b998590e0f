"""`AC_TRACE=1`: what the activation-checkpointing policies decided, logged once each.

Why: a policy that silently recomputes a model's most expensive op makes op-level SAC
no better than full AC, and nothing else would show it. With the environment variable
set, rank 0 logs each distinct (op, verdict) pair once through the `ac` logger
(`AC_TRACE SAVE aten.topk.default`), and the memory-budget policy logs the set it chose
per block. `reset_ac_trace()` forgets what was logged, so it is logged again.
"""

from __future__ import annotations

import logging

from configuration.environment import env_flag

logger = logging.getLogger("ac")

_TRACED: set = set()


def reset_ac_trace() -> None:
    """Forget which (op, verdict) pairs were logged, so AC_TRACE=1 logs them again."""
    _TRACED.clear()


def trace_enabled() -> bool:
    """AC_TRACE is set (and not 0/false/no/off), and this is rank 0 (or not distributed)."""
    if not env_flag("AC_TRACE"):
        return False
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return False
    except Exception:  # noqa: BLE001
        pass
    return True


def trace(func, verdict: str, note: str = "") -> None:
    """Logs `AC_TRACE <verdict> <op> (<note>)` the first time this (op, verdict) is seen."""
    key = (str(func), verdict)
    if key in _TRACED:
        return
    _TRACED.add(key)
    logger.info("AC_TRACE %s %s%s", verdict, func, f" ({note})" if note else "")


def trace_line(key: str, line: str) -> None:
    """Logs `AC_TRACE <line>` once per `key` (e.g. a memory-budget choice per block kind)."""
    if ("line", key) in _TRACED:
        return
    _TRACED.add(("line", key))
    logger.info("AC_TRACE %s", line)
