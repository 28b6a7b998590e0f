"""The op sets the activation-checkpointing policies reason about, and per-op FLOP formulas.

Why a module of its own: which aten / c10d ops count as "compute-intensive",
"collective", "matmul" or "runtime" is knowledge about PyTorch, not about a policy.
Every policy (op-level SAC, the eager memory budget), the AC trace and the counters
in `ac_measure` read the same sets from here, so a new torch release or a new
collective is taught to all of them in one place.

Ops are compared as overload packets (`aten.mm`), so every overload of a listed op
matches; higher-order ops have no packet and are compared as themselves (`op_key`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch


def lookup(namespace: str, name: str, overload: str | None = None):
    """torch.ops.<namespace>.<name>[.<overload>], or None if this torch build lacks it."""
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        return getattr(packet, overload) if overload else packet
    except (AttributeError, RuntimeError):
        return None


def op_key(op):
    """The overload packet of `op` (what the sets below hold), or the op itself for a HOP."""
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
_FUNCTIONAL_NAMESPACES = ("aten", "_c10d_functional", "c10d_functional")
_MISC_SAVE = ("topk",)
# Every attention variant's aten packet (the recompute plan keeps the inputs of these).
ATTENTION_OPS = frozenset(op for op in (lookup("aten", n) for n in _ATTENTION) if op is not None)


def _functional(*names: str) -> frozenset:
    ops = {lookup(ns, n) for ns in _FUNCTIONAL_NAMESPACES for n in names}
    ops.discard(None)
    return frozenset(ops)


# The model's own collectives (TP/SP, EP, CP): functional, so their outputs are tensors
# that the SAC cache can hold. All-gathers are a separate set: under sequence parallel
# each is a full-sequence [B, S, D] tensor, and whether to keep them is a policy choice.
REDUCE_SCATTER_OPS: frozenset = _functional("reduce_scatter_tensor")
ALL_TO_ALL_OPS: frozenset = _functional("all_to_all_single")
ALL_GATHER_OPS: frozenset = _functional("all_gather_into_tensor")
COLLECTIVE_OPS: frozenset = REDUCE_SCATTER_OPS | ALL_TO_ALL_OPS | ALL_GATHER_OPS

# Matmuls whose outputs op-level SAC alternates between save (odd count) and recompute.
MATMUL_OPS: frozenset = frozenset(
    op for op in (lookup("aten", n) for n in ("mm", "linear", "_grouped_mm", "_scaled_grouped_mm")) if op is not None
)

# Namespaces of runtime ops that must never reach the SAC storage: FSDP2's copy-in /
# split-copy ops and the profiler's record_function ops can run in only one of the
# two passes, which would shift the per-op invocation index of the cache. And the
# legacy in-place c10d collectives: model code here only uses functional collectives
# (`_c10d_functional`), so inside a checkpointed block these are FSDP2's own (an FSDP
# unit nested in the block: routed experts under EP with efsdp > 1, or HSDP), e.g.
# `c10d._allgather_base_` for the parameters. Saving its output would keep the
# gathered parameters alive until backward and defeat resharding.
RUNTIME_OP_NAMESPACES = ("fsdp", "profiler", "c10d")

D2H_OPS: tuple = tuple(op for op in (lookup("aten", "_to_copy"), lookup("aten", "_local_scalar_dense")) if op is not None)


def is_runtime_op(func) -> bool:
    """FSDP's and the profiler's ops: never cached, run in whichever pass runs them."""
    return getattr(func, "namespace", None) in RUNTIME_OP_NAMESPACES


def is_device_to_host(args, out) -> bool:
    """A copy from an accelerator to the host (`.to("cpu")`, `.item()`, `.tolist()`)."""
    src = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if src is None or src.device.type in ("cpu", "meta"):
        return False
    if isinstance(out, torch.Tensor):
        return out.device.type == "cpu"
    return True  # _local_scalar_dense: a Python scalar read from the device


def partitioner_compute_ops() -> set:
    """PyTorch's own list of compute-intensive ops, or an empty set if the private API moved."""
    try:
        from torch._functorch.partitioners import get_default_op_list
        return {op_key(op) for op in get_default_op_list().compute_intensive_ops}
    except Exception:  # noqa: BLE001 - private API; the curated set below still applies
        return set()


def compiled_region_hop():
    """The HOP that torch.compile uses for a compiled region nested in eager code, if any."""
    try:
        from torch._higher_order_ops.wrap import inductor_compiled_code
        return inductor_compiled_code
    except Exception:  # noqa: BLE001
        return getattr(getattr(torch.ops, "higher_order", None), "inductor_compiled_code", None)


def flex_attention_hop():
    try:
        from torch._higher_order_ops.flex_attention import flex_attention
        return flex_attention
    except Exception:  # noqa: BLE001
        return None


@functools.lru_cache(maxsize=None)
def _base_save_ops(seed_from_partitioner: bool = True) -> frozenset:
    ops: set = set()
    if seed_from_partitioner:
        ops |= partitioner_compute_ops()
    ops |= {lookup("aten", n) for n in _CURATED_COMPUTE + _ATTENTION + _MISC_SAVE}
    ops |= COLLECTIVE_OPS
    ops |= {compiled_region_hop(), flex_attention_hop()}
    ops.discard(None)
    # The matmuls alternate; they are not in the always-save set.
    return frozenset(op_key(op) for op in ops) - MATMUL_OPS


def default_save_ops(extra: Iterable = (), *, seed_from_partitioner: bool = True) -> frozenset:
    """The ops whose outputs op-level SAC always saves.

    Seeded from `torch._functorch.partitioners.get_default_op_list().compute_intensive_ops`
    (guarded: the API is private) plus a curated set: every SDPA backend including
    `aten._scaled_dot_product_flash_attention_for_cpu`, flex attention, the functional
    collectives `reduce_scatter_tensor` / `all_to_all_single` / `all_gather_into_tensor`
    (aten and `_c10d_functional`), `aten.topk` and the compiled-region HOP
    `inductor_compiled_code`. `extra` (a model spec's or a parallel plan's ops, such as EP
    dispatch/combine) is added. The matmuls in `MATMUL_OPS` are excluded: they alternate.
    Device-to-host copies are recognised per call, by device, by the policy.
    """
    return _base_save_ops(seed_from_partitioner) | frozenset(op_key(op) for op in extra)


# ---------------------------------------------------------------------------
# FLOPs per op: FlopCounterMode's registry plus the ops it lacks
# ---------------------------------------------------------------------------

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


def cpu_attention_flop_mapping() -> dict:
    """`custom_mapping` for FlopCounterMode: CPU flash attention and its backward, which
    its registry lacks, counted with the same formulas as the CUDA SDPA backends."""
    mapping = {}
    fwd = lookup("aten", "_scaled_dot_product_flash_attention_for_cpu")
    bwd = lookup("aten", "_scaled_dot_product_flash_attention_for_cpu_backward")
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
        op = lookup("aten", name)
        if op is not None:
            mapping[op] = _grouped_mm_flop
    return mapping


@functools.lru_cache(maxsize=1)
def _flop_formulas() -> dict:
    from torch.utils.flop_counter import flop_registry, shape_wrapper
    return {**flop_registry, **{op_key(k): shape_wrapper(v) for k, v in extra_flop_mapping().items()}}


def has_flop_formula(op) -> bool:
    """Whether FlopCounterMode (with `extra_flop_mapping`) counts FLOPs for `op`."""
    return op_key(op) in _flop_formulas()


def _local(x):
    """The data this rank computes on: a DTensor's local shard, other values as they are."""
    local = getattr(x, "_local_tensor", None) if isinstance(x, torch.Tensor) else None
    return x if local is None else local


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one call of `func` as FlopCounterMode counts them (0 for the ops it does
    not count: element-wise ops, views, collectives), on this rank's local shapes."""
    formula = _flop_formulas().get(op_key(func))
    if formula is None:
        return 0
    from torch.utils._pytree import tree_map
    args, kwargs, out = tree_map(_local, (args, kwargs or {}, out))
    return int(formula(*args, out_val=out, **kwargs))


def draws_random(func, args, kwargs) -> bool:
    """Whether one call of `func` draws from the RNG: a `nondeterministic_seeded` op,
    unless its `dropout_p` argument is 0 (attention without dropout is deterministic,
    yet tagged for the argument)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    schema = getattr(func, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" not in names:
        return True
    position = names.index("dropout_p")
    p = kwargs.get("dropout_p") if kwargs and "dropout_p" in kwargs else \
        args[position] if position < len(args) else schema.arguments[position].default_value
    return not (isinstance(p, (int, float)) and p == 0)


# Ops whose output shape or value is read from data (`nonzero`, `.item()`): a replay of a
# recorded call's arguments or outputs would not hold for other data.
DATA_DEPENDENT_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
