"""Activation checkpointing: none / full / selective / op / memory_budget.

What each transformer block keeps for the backward pass, and what it recomputes.
User guide: docs/activation_checkpointing.md. Design: the project's AC design note.

Public surface
--------------
- `ActivationCheckpointConfig`: the `[activation_checkpoint]` config section.
- `apply_activation_checkpointing(model, cfg, *, extra_save_ops, force_recompute_fqns,
  compile_enabled)`: wraps the blocks of `model.layers` in place (after TP, before
  compile and FSDP). State-dict keys do not change.
- `default_save_ops(extra)`, `MATMUL_OPS`, `OpSACPolicy`, `op_sac_context_fn(...)`:
  the op-level selective-checkpointing (SAC) policy and its op sets.
- `block_mode(cfg, layer_id)`: what a given block gets (selective resolves per layer).
- `SavedActivationCounter`, `saved_activation_bytes(block, *inputs, mode=..., cfg=...)`:
  exact count of the activation bytes kept for backward, including what the SAC
  cache holds; works on real tensors, under `FakeTensorMode` and on the meta device.
- `cpu_attention_flop_mapping()`, `extra_flop_mapping()`, `flop_counter()`:
  `FlopCounterMode` that also counts CPU flash attention (forward and backward) and
  MoE grouped GEMMs.
- `reset_ac_trace()`: forget which ops were already logged by `AC_TRACE=1`.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import os
import re
import weakref
from collections.abc import Callable, Iterable
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from trainer.configurable import opt

logger = logging.getLogger("ac")

AC_MODES = ("none", "full", "selective", "op", "memory_budget")


def _parse_mode(value):
    # `mode = true` / `false` are accepted as the common shorthands.
    if isinstance(value, bool):
        return "full" if value else "none"
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return "full" if value.lower() == "true" else "none"
    return value


@dataclass
class ActivationCheckpointConfig:
    """[activation_checkpoint]: what each transformer block keeps for backward."""

    mode: str = opt("none", "none, full, selective (every Nth block), op (per-op SAC) or memory_budget "
                    "(compile picks; needs compile.enable). true = full, false = none.",
                    choices=AC_MODES, parse=_parse_mode)
    selective_layer_interval: int = opt(2, "For mode=selective: checkpoint every Nth block (blocks whose "
                                        "layer id is a multiple of N, starting at 0).", min=1)
    memory_budget: float = opt(0.5, "For mode=memory_budget: 0 = recompute all, 1 = save all.", min=0.0, max=1.0)
    force_recompute_mm_fqns: list[str] = opt([], "Module-name patterns (fnmatch) whose matmuls are always recomputed.")
    preserve_rng_state: bool = opt(True, "Restore RNG state in the recompute so dropout masks match.")

    def validate(self, root) -> None:
        from trainer.configurable import ConfigError
        if self.mode == "memory_budget" and not root.compile.enable:
            raise ConfigError("config error: activation_checkpoint.mode: memory_budget needs compile; "
                              "set --compile.enable true or pick another mode")


def _check_cfg(cfg: ActivationCheckpointConfig, compile_enabled: bool | None = None) -> str:
    """Validates a config built in code (not through load_config). Returns the mode."""
    mode = _parse_mode(cfg.mode)
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode: {cfg.mode!r} is not one of {', '.join(AC_MODES)}")
    if mode == "selective" and int(cfg.selective_layer_interval) < 1:
        raise ValueError(f"activation_checkpoint.selective_layer_interval: {cfg.selective_layer_interval} "
                         "is below the minimum 1")
    if mode == "memory_budget":
        if not 0.0 <= float(cfg.memory_budget) <= 1.0:
            raise ValueError(f"activation_checkpoint.memory_budget: {cfg.memory_budget} is outside [0, 1]")
        if compile_enabled is False:
            raise ValueError("activation_checkpoint.mode: memory_budget needs compile; "
                             "set --compile.enable true or pick another mode")
    return mode


# ---------------------------------------------------------------------------
# Op sets
# ---------------------------------------------------------------------------

def _lookup(namespace: str, name: str, overload: str | None = None):
    """torch.ops.<namespace>.<name>[.<overload>] or None if this torch build lacks it."""
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        return getattr(packet, overload) if overload else packet
    except (AttributeError, RuntimeError):
        return None


def _key(op):
    """Ops are compared as overload packets (aten.mm), so every overload of a listed op
    matches; higher-order ops have no packet and are compared as themselves."""
    return getattr(op, "overloadpacket", op)


# Curated always-save set: used on its own if the partitioner's list is unavailable.
_CURATED_COMPUTE = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_mm")
_ATTENTION = (
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_cudnn_attention_forward",
)
_COLLECTIVES = ("reduce_scatter_tensor", "all_to_all_single", "all_gather_into_tensor")
# Legacy in-place c10d spellings of the same collectives.
_C10D_COLLECTIVES = ("_reduce_scatter_base_", "_allgather_base_", "alltoall_base_", "reduce_scatter_tensor_coalesced_",
                     "allgather_into_tensor_coalesced_")
_MISC_SAVE = ("topk",)

# Matmuls whose outputs alternate save (odd count) / recompute (even count).
MATMUL_OPS: frozenset = frozenset(
    op for op in (_lookup("aten", n) for n in ("mm", "linear", "_grouped_mm", "_scaled_grouped_mm")) if op is not None
)

# Namespaces of runtime ops that must never reach the SAC storage: FSDP2's copy-in /
# split-copy ops and the profiler's record_function ops can run in only one of the
# two passes, which would shift the per-op invocation index of the cache.
RUNTIME_OP_NAMESPACES = ("fsdp", "profiler")

_D2H_OPS = tuple(op for op in (_lookup("aten", "_to_copy"), _lookup("aten", "_local_scalar_dense")) if op is not None)


def _partitioner_compute_ops() -> set:
    """PyTorch's own list of compute-intensive ops, or an empty set if the private API moved."""
    try:
        from torch._functorch.partitioners import get_default_op_list
        return {_key(op) for op in get_default_op_list().compute_intensive_ops}
    except Exception:  # noqa: BLE001 - private API; the curated set below still applies
        return set()


def _compiled_region_hop():
    """The HOP that torch.compile uses for a compiled region nested in eager code, if any."""
    try:
        from torch._higher_order_ops.wrap import inductor_compiled_code
        return inductor_compiled_code
    except Exception:  # noqa: BLE001
        return getattr(getattr(torch.ops, "higher_order", None), "inductor_compiled_code", None)


def _flex_attention_hop():
    try:
        from torch._higher_order_ops.flex_attention import flex_attention
        return flex_attention
    except Exception:  # noqa: BLE001
        return None


@functools.lru_cache(maxsize=None)
def _base_save_ops(seed_from_partitioner: bool = True) -> frozenset:
    ops: set = set()
    if seed_from_partitioner:
        ops |= _partitioner_compute_ops()
    ops |= {_lookup("aten", n) for n in _CURATED_COMPUTE + _ATTENTION + _MISC_SAVE}
    for ns in ("aten", "_c10d_functional", "c10d_functional"):
        ops |= {_lookup(ns, n) for n in _COLLECTIVES}
    ops |= {_lookup("c10d", n) for n in _C10D_COLLECTIVES}
    ops |= {_compiled_region_hop(), _flex_attention_hop()}
    ops.discard(None)
    # The matmuls alternate; they are not in the always-save set.
    return frozenset(_key(op) for op in ops) - MATMUL_OPS


def default_save_ops(extra: Iterable = (), *, seed_from_partitioner: bool = True) -> frozenset:
    """The ops whose outputs op-level SAC always saves.

    Seeded from `torch._functorch.partitioners.get_default_op_list().compute_intensive_ops`
    (guarded: the API is private) plus a curated set: every SDPA backend including
    `aten._scaled_dot_product_flash_attention_for_cpu`, flex attention, the collectives
    `reduce_scatter_tensor` / `all_to_all_single` / `all_gather_into_tensor` (aten,
    `_c10d_functional` and legacy c10d), `aten.topk` and the compiled-region HOP
    `inductor_compiled_code`. `extra` (e.g. a model spec's `sac_save_ops`, such as EP
    dispatch/combine ops) is added. The matmuls in `MATMUL_OPS` are excluded: they alternate.
    Device-to-host copies are recognised per call, by device, in `OpSACPolicy`.
    """
    return _base_save_ops(seed_from_partitioner) | frozenset(_key(op) for op in extra)


# ---------------------------------------------------------------------------
# AC_TRACE diagnostics
# ---------------------------------------------------------------------------

_TRACED: set = set()


def reset_ac_trace() -> None:
    """Forget which (op, verdict) pairs were logged, so AC_TRACE=1 logs them again."""
    _TRACED.clear()


def _trace_enabled() -> bool:
    if os.environ.get("AC_TRACE", "0").strip().lower() in ("", "0", "false", "no", "off"):
        return False
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return False
    except Exception:  # noqa: BLE001
        pass
    return True


def _trace(func, verdict: str, note: str = "") -> None:
    key = (str(func), verdict)
    if key in _TRACED:
        return
    _TRACED.add(key)
    logger.info("AC_TRACE %s %s%s", verdict, func, f" ({note})" if note else "")


# ---------------------------------------------------------------------------
# The op-level policy
# ---------------------------------------------------------------------------

_WRAPPER_ATTRS = frozenset({"L", "G", "self", "_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def _module_path(name: str) -> str:
    """A module path relative to the traced block from a dynamo source name such as
    `L['self'].__dict__['_modules']['_checkpoint_wrapped_module'].feed_forward.w3`."""
    name = re.sub(r"(?:\.__dict__)?(?:\._modules|\[['\"]_modules['\"]\])\[['\"]([^'\"]+)['\"]\]", r".\1", name)
    name = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", name)
    return ".".join(p for p in name.split(".") if p and p not in _WRAPPER_ATTRS)


# Modules whose matmuls are force-recomputed -> their full name; and the names of those
# currently executing. Maintained by one pair of *global* module hooks: per-module hooks
# would have distinct ids per block, which dynamo guards on, recompiling every block.
_FORCED_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FORCED_STACK: list[str] = []
_GLOBAL_HOOKS: list = []


def _forced_pre_hook(module, args):
    if torch.compiler.is_compiling():  # traced away under compile; see _ModuleScope.current
        return
    name = _FORCED_MODULES.get(module)
    if name is not None:
        _FORCED_STACK.append(name)


def _forced_post_hook(module, args, output):
    if torch.compiler.is_compiling():
        return
    if _FORCED_STACK and _FORCED_MODULES.get(module) is not None:
        _FORCED_STACK.pop()


def _ensure_global_hooks() -> None:
    if not _GLOBAL_HOOKS:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        _GLOBAL_HOOKS.append(register_module_forward_pre_hook(_forced_pre_hook))
        _GLOBAL_HOOKS.append(register_module_forward_hook(_forced_post_hook, always_call=True))


class _ModuleScope:
    """Knows whether execution is inside a module whose matmuls are force-recomputed.

    In eager mode, global forward pre/post hooks keep a stack of the matching modules
    being run; this is right in the forward and also in the recompute (which re-runs
    the same module calls) on torch releases that call the policy there. Under
    torch.compile the hooks are traced away and the policy runs while AOTAutograd
    traces the graph: there the current FX node's `nn_module_stack` is read instead.
    Patterns match the module name relative to the block (`feed_forward.w3`) or with
    the block's prefix (`layers.3.feed_forward.w3`).
    """

    def __init__(self, patterns: tuple[str, ...]):
        self.patterns = tuple(p for p in patterns if p)
        self.prefix = ""
        self.modules: list[nn.Module] = []

    def matches(self, *names: str) -> bool:
        return any(fnmatch.fnmatchcase(n, p) for n in names if n for p in self.patterns)

    def install(self, block: nn.Module, prefix: str) -> int:
        self.prefix = prefix
        for rel, mod in block.named_modules():
            full = f"{prefix}.{rel}" if prefix and rel else (prefix or rel)
            if self.matches(rel, full):
                _FORCED_MODULES[mod] = full
                self.modules.append(mod)
        if self.modules:
            _ensure_global_hooks()
        return len(self.modules)

    def remove(self) -> None:
        for mod in self.modules:
            _FORCED_MODULES.pop(mod, None)
        self.modules.clear()

    def current(self) -> str | None:
        if not self.patterns:
            return None
        if _FORCED_STACK:
            return _FORCED_STACK[-1]
        try:  # under compile: the node being traced knows its module path
            import torch.fx.traceback as fx_traceback
            meta = fx_traceback.get_current_meta() if hasattr(fx_traceback, "get_current_meta") else None
            for key, val in ((meta or {}).get("nn_module_stack") or {}).items():
                rel = _module_path(val[0] if isinstance(val, tuple) else str(key))
                if self.matches(rel, f"{self.prefix}.{rel}" if self.prefix and rel else rel):
                    return rel
        except Exception:  # noqa: BLE001
            pass
        return None


_ACTIVE_COUNTERS: list = []


class OpSACPolicy:
    """Policy function for `torch.utils.checkpoint.create_selective_checkpoint_contexts`.

    One instance serves one checkpointed call of one block (a fresh one is built by the
    context_fn on every call, so the counts reset per call). Decisions, in order:

    1. runtime ops (namespaces in `RUNTIME_OP_NAMESPACES`) -> PREFER_RECOMPUTE;
    2. matmuls (`MATMUL_OPS`) inside a force-recompute module -> PREFER_RECOMPUTE, not counted;
    3. matmuls a model spec lists explicitly (`explicit_save_ops`) -> MUST_SAVE, not counted;
       other matmuls -> ALTERNATE: MUST_SAVE on odd counts, PREFER_RECOMPUTE on even ones;
    4. `save_ops` and device-to-host copies -> MUST_SAVE;
    5. everything else -> PREFER_RECOMPUTE.

    The matmul count is keyed on `ctx.is_recompute`: torch releases that call the policy
    again in the recompute then start that pass from zero too, so both passes agree even
    with an odd matmul count. (torch 2.13 only calls it in the forward.)
    """

    def __init__(self, save_ops: frozenset, *, scope: _ModuleScope | None = None, trace: bool = False,
                 explicit_save_ops: frozenset = frozenset()):
        self.save_ops = save_ops
        self.explicit_save_ops = frozenset(_key(op) for op in explicit_save_ops)
        self.scope = scope
        self.trace = trace
        self.mm_count = {False: 0, True: 0}

    def decide(self, func, is_recompute: bool, args=(), out=None):
        """(CheckpointPolicy, verdict, note) for one op; advances the matmul count."""
        from torch.utils.checkpoint import CheckpointPolicy as P
        key = _key(func)
        if getattr(func, "namespace", None) in RUNTIME_OP_NAMESPACES:
            return P.PREFER_RECOMPUTE, "RECOMPUTE", "runtime op"
        if key in MATMUL_OPS:
            forced = self.scope.current() if self.scope is not None else None
            if forced is not None:
                return P.PREFER_RECOMPUTE, "RECOMPUTE", f"force_recompute_mm_fqns: {forced}"
            if key in self.explicit_save_ops:
                return P.MUST_SAVE, "SAVE", "model spec"
            self.mm_count[is_recompute] += 1
            odd = self.mm_count[is_recompute] % 2 == 1
            return (P.MUST_SAVE if odd else P.PREFER_RECOMPUTE), "ALTERNATE", ""
        if key in self.save_ops or func in self.save_ops:
            return P.MUST_SAVE, "SAVE", ""
        if key in _D2H_OPS and _is_device_to_host(args, out):
            return P.MUST_SAVE, "SAVE", "device-to-host copy"
        return P.PREFER_RECOMPUTE, "RECOMPUTE", ""

    def __call__(self, ctx, func, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy as P
        is_recompute = bool(getattr(ctx, "is_recompute", False))
        out = getattr(ctx, "op_output", None)
        policy, verdict, note = self.decide(func, is_recompute, args, out)
        if self.trace:
            _trace(func, verdict, note)
        if policy is P.MUST_SAVE and not is_recompute and _ACTIVE_COUNTERS and not _tracing_for_compile():
            # (While torch.compile traces, op_output is symbolic; the compiled graph's own
            # saved tensors are what the outer hook then counts.)
            if not hasattr(ctx, "op_output"):
                raise RuntimeError("counting the SAC cache needs SelectiveCheckpointContext.op_output "
                                   f"(torch >= 2.10); this is torch {torch.__version__}")
            for counter in _ACTIVE_COUNTERS:
                counter.add(out, "sac_cache")
        return policy


def _tracing_for_compile() -> bool:
    try:
        return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None
    except Exception:  # noqa: BLE001
        return torch.compiler.is_compiling()


def _is_device_to_host(args, out) -> bool:
    src = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if src is None or src.device.type in ("cpu", "meta"):
        return False
    if isinstance(out, torch.Tensor):
        return out.device.type == "cpu"
    return True  # _local_scalar_dense: a Python scalar read from the device


def _make_sac_modes(policy) -> tuple:
    """create_selective_checkpoint_contexts(policy), with runtime ops kept out of the
    cache in eager mode (on torch 2.13 the recompute replays the cache by per-op index
    without calling the policy, so an op that only one pass runs must bypass it)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    fwd, rec = create_selective_checkpoint_contexts(policy)
    for mode in (fwd, rec):
        cls = _BYPASS_CLASSES.get(type(mode))
        if cls is not None:
            mode.__class__ = cls
    return fwd, rec


def _bypass_class(base):
    try:
        from torch.utils.checkpoint import _is_compiling
    except ImportError:  # pragma: no cover - older torch
        def _is_compiling(func, args, kwargs):
            return torch.compiler.is_compiling()

    class _RuntimeOpBypass(base):  # type: ignore[misc, valid-type]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(func, "namespace", None) in RUNTIME_OP_NAMESPACES and not _is_compiling(func, args, kwargs):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    _RuntimeOpBypass.__name__ = _RuntimeOpBypass.__qualname__ = f"_RuntimeOpBypass{base.__name__}"
    return _RuntimeOpBypass


def _init_bypass_classes() -> dict:
    try:
        from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode
    except ImportError:  # pragma: no cover - the policy's PREFER_RECOMPUTE still applies
        return {}
    return {b: _bypass_class(b) for b in (_CachingTorchDispatchMode, _CachedTorchDispatchMode)}


_BYPASS_CLASSES = _init_bypass_classes()


def op_sac_context_fn(*, extra_save_ops: Iterable = (), force_recompute_fqns: Iterable[str] = (),
                      block: nn.Module | None = None, prefix: str = "") -> Callable[[], tuple]:
    """A `context_fn` for `torch.utils.checkpoint.checkpoint` applying the op-level policy.

    Each call builds a fresh `OpSACPolicy`, so the matmul counts reset per block call.
    `extra_save_ops` (a model spec's `sac_save_ops`) are always saved; a matmul listed
    there (e.g. `_grouped_mm` for MoE experts) is then saved instead of alternating.
    If `block` is given and a pattern in `force_recompute_fqns` matches one of its
    submodules (relative name, or `prefix.relative`), hooks are installed on those
    submodules; `context_fn.scope.remove()` takes them off again.
    """
    save_ops = default_save_ops(extra_save_ops)
    explicit = frozenset(_key(op) for op in extra_save_ops)
    scope = _ModuleScope(tuple(force_recompute_fqns))
    if block is not None and scope.patterns:
        scope.install(block, prefix)

    def context_fn():
        # A plain closure (not a partial of objects) so that dynamo accepts it.
        return _make_sac_modes(OpSACPolicy(save_ops, scope=scope, trace=_trace_enabled(), explicit_save_ops=explicit))

    context_fn.scope = scope  # type: ignore[attr-defined]
    return context_fn


# ---------------------------------------------------------------------------
# Applying AC to a model
# ---------------------------------------------------------------------------

def _layer_id(name: str, position: int) -> int:
    try:
        return int(name)
    except ValueError:
        return position


def _selected_for_selective(name: str, position: int, interval: int) -> bool:
    # Keyed on the global layer id, so a pipeline stage picks the same blocks as one process.
    return _layer_id(name, position) % interval == 0


def block_mode(cfg: ActivationCheckpointConfig, layer_id: int) -> str:
    """How block `layer_id` is treated under `cfg`: "none", "full", "op" or
    "memory_budget" (selective resolves to "full" or "none" by layer id)."""
    mode = _parse_mode(cfg.mode)
    if mode == "selective":
        return "full" if layer_id % cfg.selective_layer_interval == 0 else "none"
    return mode


def _wrap_block(block: nn.Module, mode: str, cfg: ActivationCheckpointConfig, *, extra_save_ops: Iterable,
                force_recompute_fqns: tuple[str, ...], prefix: str) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    kwargs: dict[str, Any] = {"preserve_rng_state": cfg.preserve_rng_state}
    if mode == "op":
        kwargs["context_fn"] = op_sac_context_fn(extra_save_ops=extra_save_ops,
                                                 force_recompute_fqns=force_recompute_fqns, block=block, prefix=prefix)
    wrapped = checkpoint_wrapper(block, **kwargs)
    wrapped._ac_mode = mode  # read by apply_compile and by tests
    return wrapped


def apply_activation_checkpointing(model: nn.Module, cfg: ActivationCheckpointConfig, *,
                                   extra_save_ops: frozenset = frozenset(),
                                   force_recompute_fqns: tuple[str, ...] = (),
                                   compile_enabled: bool = False) -> None:
    """Wraps the blocks of `model.layers` in place according to `cfg.mode`.

    Call after TP and before compile and FSDP, on every model part. Blocks are wrapped
    with `checkpoint_wrapper` (non-reentrant), whose state-dict hooks keep the keys
    unchanged, so a checkpoint saved under one mode loads under any other.

    - none: nothing. memory_budget: nothing here (`apply_compile` sets the budget);
      raises if compile is off.
    - full: every block; selective: blocks whose layer id is a multiple of
      `cfg.selective_layer_interval`; op: every block, with the op-level SAC policy.
    `extra_save_ops` (a spec's `sac_save_ops`) extends the always-save set;
    `force_recompute_fqns` (a spec's `sac_force_recompute_fqns`) and
    `cfg.force_recompute_mm_fqns` are fnmatch patterns of module names whose matmuls are
    always recomputed. The same mode is applied whatever the world size.
    """
    mode = _check_cfg(cfg, compile_enabled)
    if mode == "none":
        return
    if mode == "memory_budget":
        logger.info("activation checkpointing: memory_budget=%s, chosen by the compile partitioner",
                    cfg.memory_budget)
        return
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        raise TypeError(f"activation checkpointing needs the blocks in `model.layers` (a ModuleDict); "
                        f"{type(model).__name__} has {type(layers).__name__}")
    patterns = tuple(force_recompute_fqns) + tuple(cfg.force_recompute_mm_fqns)
    items = list(layers.items()) if isinstance(layers, nn.ModuleDict) else [(str(i), b) for i, b in enumerate(layers)]
    wrapped = 0
    for position, (name, block) in enumerate(items):
        if getattr(block, "_ac_mode", None) is not None:
            raise RuntimeError(f"layers.{name} is already activation-checkpointed")
        if mode == "selective" and not _selected_for_selective(name, position, cfg.selective_layer_interval):
            continue
        block_mode = "full" if mode == "selective" else mode
        new = _wrap_block(block, block_mode, cfg, extra_save_ops=extra_save_ops,
                          force_recompute_fqns=patterns, prefix=f"layers.{name}")
        layers[name if isinstance(layers, nn.ModuleDict) else int(name)] = new
        wrapped += 1
    logger.info("activation checkpointing: mode=%s, %d of %d blocks wrapped", mode, wrapped, len(items))


def unwrap_block(module: nn.Module) -> nn.Module:
    """The block inside a checkpoint wrapper (or the module itself)."""
    return getattr(module, "_checkpoint_wrapped_module", module)


# ---------------------------------------------------------------------------
# Counting what is saved for backward
# ---------------------------------------------------------------------------

def _storage_key(t: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(t.untyped_storage())


def _plain_tensors(t: torch.Tensor):
    """The plain tensors behind a tensor subclass (DTensor, FSDP params, ...)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        try:
            names, _ = t.__tensor_flatten__()
            for n in names:  # (DTensor also lists its device mesh)
                inner = getattr(t, n)
                if isinstance(inner, torch.Tensor):
                    yield from _plain_tensors(inner)
            return
        except Exception:  # noqa: BLE001
            pass
    yield t


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class SavedActivationCounter:
    """Context manager counting the activation bytes kept for backward.

    Two sources are counted, deduplicated by storage:

    - `autograd`: tensors autograd saves outside checkpointed regions, seen through an
      outer `torch.autograd.graph.saved_tensors_hooks` (for a checkpointed block this is
      only the block's inputs, which the checkpoint keeps to re-run it);
    - `sac_cache`: outputs that the op-level policy decides to SAVE, read from the
      policy's `ctx.op_output` (torch 2.13). An outer hook cannot see these.

    Not counted: parameters and views of parameters (also FSDP's unsharded ones), any
    tensor sharing storage with a tensor in `exclude` (pass the model's parameters and
    buffers, and constant inputs such as RoPE tables). The byte count of a tensor is the
    size of its whole storage, since a saved view keeps all of it alive.
    Works with real tensors, FakeTensorMode and the meta device (only storage sizes are read).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {_storage_key(p) for t in exclude for p in _plain_tensors(t)}
        self._seen: set = set()
        self.bytes_by_source = {"autograd": 0, "sac_cache": 0}
        self.num_tensors = 0
        self._hooks = None

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_source.values())

    def add(self, obj: Any, source: str) -> None:
        if isinstance(obj, (list, tuple)):
            for o in obj:
                self.add(o, source)
            return
        if not isinstance(obj, torch.Tensor) or _is_parameter(obj):
            return
        for t in _plain_tensors(obj):
            if _is_parameter(t):
                continue
            try:
                key = _storage_key(t)
                nbytes = t.untyped_storage().nbytes()
            except Exception:  # noqa: BLE001 - storage-less tensors: count the tensor itself
                key, nbytes = ("id", id(t)), t.numel() * t.element_size()
            if key in self._exclude or key in self._seen:
                continue
            self._seen.add(key)
            self.bytes_by_source[source] += int(nbytes)
            self.num_tensors += 1

    def _pack(self, t):
        self.add(t, "autograd")
        return t

    def __enter__(self) -> SavedActivationCounter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        _ACTIVE_COUNTERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE_COUNTERS.remove(self)
        self._hooks.__exit__(*exc)
        self._hooks = None


def saved_activation_bytes(block: nn.Module, *inputs: Any, mode: str = "op",
                           cfg: ActivationCheckpointConfig | None = None,
                           extra_save_ops: Iterable = (), force_recompute_fqns: Iterable[str] = (),
                           layer_id: int = 0, breakdown: bool = False, **kwargs: Any):
    """Exact activation bytes one block keeps for backward under `mode`.

    Runs `block(*inputs, **kwargs)` once (forward only, under grad mode) exactly as
    `apply_activation_checkpointing` would wrap it, without modifying `block`, and
    counts with `SavedActivationCounter`: autograd-saved tensors outside the checkpoint
    (for `full`/`op`: the block inputs) plus the SAC cache (for `op`).

    - mode: none | full | op | selective (then `layer_id` decides whether this block is
      checkpointed, as in the trainer) | memory_budget (raises: the compile partitioner
      decides, there is no eager equivalent) | True/False.
    - cfg: supplies `selective_layer_interval` and `force_recompute_mm_fqns`.
    - Pass hidden-state inputs with `requires_grad=True`, as in training. Inputs that do
      not require grad (RoPE tables, masks) are treated as constants owned by the caller
      and not counted; nor are the block's parameters and buffers.
    - Works on real tensors, under `FakeTensorMode` (build the block and inputs under it)
      and on the meta device; nothing is allocated for real in the latter two.

    Returns an int, or `(total, {"autograd": .., "sac_cache": ..})` with `breakdown=True`.
    """
    from torch.utils.checkpoint import checkpoint
    cfg = cfg or ActivationCheckpointConfig()
    mode = _parse_mode(mode)
    if mode == "memory_budget":
        raise ValueError("saved_activation_bytes: memory_budget is decided by the compile partitioner; "
                         "there is no eager count")
    if mode not in AC_MODES:
        raise ValueError(f"saved_activation_bytes: mode {mode!r} is not one of {', '.join(AC_MODES)}")
    block = unwrap_block(block)
    if mode == "selective":
        mode = block_mode(dataclasses.replace(cfg, mode="selective"), layer_id)
    exclude = list(block.parameters()) + list(block.buffers())
    exclude += [t for t in inputs if isinstance(t, torch.Tensor) and not t.requires_grad]
    context_fn = None
    if mode == "op":
        patterns = tuple(force_recompute_fqns) + tuple(cfg.force_recompute_mm_fqns)
        context_fn = op_sac_context_fn(extra_save_ops=extra_save_ops, force_recompute_fqns=patterns,
                                       block=block, prefix=f"layers.{layer_id}")
    try:
        with torch.enable_grad(), SavedActivationCounter(exclude) as counter:
            if mode == "none":
                block(*inputs, **kwargs)
            elif mode == "full":
                checkpoint(block, *inputs, use_reentrant=False, preserve_rng_state=False, **kwargs)
            else:
                checkpoint(block, *inputs, use_reentrant=False, preserve_rng_state=False,
                           context_fn=context_fn, **kwargs)
    finally:
        if context_fn is not None:
            context_fn.scope.remove()
    if breakdown:
        return counter.total_bytes, dict(counter.bytes_by_source)
    return counter.total_bytes


# ---------------------------------------------------------------------------
# FLOP counting with CPU attention
# ---------------------------------------------------------------------------

def cpu_attention_flop_mapping() -> dict:
    """`custom_mapping` for FlopCounterMode: CPU flash attention and its backward, which
    its registry lacks, counted with the same formulas as the CUDA SDPA backends."""
    mapping = {}
    fwd = _lookup("aten", "_scaled_dot_product_flash_attention_for_cpu")
    bwd = _lookup("aten", "_scaled_dot_product_flash_attention_for_cpu_backward")
    if fwd is not None:
        mapping[fwd] = _cpu_sdpa_flop
    if bwd is not None:
        mapping[bwd] = _cpu_sdpa_backward_flop
    return mapping


def extra_flop_mapping() -> dict:
    """`cpu_attention_flop_mapping()` plus the grouped GEMMs of MoE experts
    (`aten._grouped_mm`, `aten._scaled_grouped_mm`), also missing from the registry."""
    mapping = cpu_attention_flop_mapping()
    for name in ("_grouped_mm", "_scaled_grouped_mm"):
        op = _lookup("aten", name)
        if op is not None:
            mapping[op] = _grouped_mm_flop
    return mapping


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """Each row (or column) meets exactly one group's matrix, so the count is that of one
    plain matmul over all rows: [M,K]x[G,K,N] -> 2MKN; [G,M,K]x[K,N] -> 2MKN;
    [K,M]x[M,N] (weight grads, offsets over M) -> 2KMN; [G,M,K]x[G,K,N] -> 2GMKN."""
    a, b = list(a_shape), list(b_shape)
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 2:
        return 2 * a[1] * a[2] * b[1]
    return 2 * a[0] * a[1] * b[1]


# FlopCounterMode passes shapes: (query, key, value, dropout_p, is_causal, ...) and
# (grad_out, query, key, value, out, logsumexp, ...). Like the CUDA backends' formulas,
# these ignore causal masking.
def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                            **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def flop_counter(**kwargs) -> torch.utils.flop_counter.FlopCounterMode:
    """FlopCounterMode(display=False) that also counts CPU flash attention and grouped GEMMs."""
    from torch.utils.flop_counter import FlopCounterMode
    kwargs.setdefault("display", False)
    mapping = {**extra_flop_mapping(), **kwargs.pop("custom_mapping", {})}
    return FlopCounterMode(custom_mapping=mapping, **kwargs)


__all__ = [
    "AC_MODES", "ActivationCheckpointConfig", "MATMUL_OPS", "OpSACPolicy", "RUNTIME_OP_NAMESPACES",
    "SavedActivationCounter", "apply_activation_checkpointing", "block_mode", "cpu_attention_flop_mapping",
    "default_save_ops", "extra_flop_mapping", "flop_counter", "op_sac_context_fn", "reset_ac_trace",
    "saved_activation_bytes",
    "unwrap_block",
]
