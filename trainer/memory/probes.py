"""Probes: run one assembled block, or the head and loss, on fake tensors and count bytes.

Why probes and not formulas: what a block keeps for backward depends on every plan the
trainer applied to it (TP's gathered inputs under sequence parallel, the AC wrapper and
its op-level SAC policy, EP's local experts) and on the kernels it calls (SDPA's
backend, the loss). Running the block as `trainer.memory.assemble` built it, on fake
tensors, counts all of that at once and nothing is allocated.

- `LiveBytesTracker`: a dispatch mode that follows every storage an op creates until
  it is freed, and the peak of their sum (transients of a backward, the loss peak).
- `SavedActivationCounter` (the AC module's exact counter, the one `measure_step`
  uses on a real step): what a forward keeps for backward.
- `strip_fsdp(part)`: the probes run the modules with FSDP's parameters already
  gathered (by FSDP's own `unshard`, into its compute dtype) and FSDP's forward hooks
  removed, so that a probe sees activations only; FSDP's buffers are counted from
  its units by the estimate. The TP and AC hooks stay.
- `balanced_experts(part)`: fake tensors carry no routing, so EP's all-to-all split
  sizes (read with `.tolist()`) do not exist; the probes model balanced routing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallelisms.ac_sac import plain_tensors


def _has_wrapper_subclass(types) -> bool:
    """Whether an op runs on a tensor subclass that computes on inner tensors (a DTensor):
    a mode that declines it (NotImplemented) then sees the local ops the subclass runs,
    with their real sizes and temporaries (a DTensor's own storage is a global-size stand-in)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(hasattr(t, "__tensor_flatten__") and not issubclass(t, FakeTensor) for t in types)


class LiveBytesTracker(TorchDispatchMode):
    """Follows every storage that an op creates while active, and the peak of their sum.

    A storage counts from the op that creates it until it is freed (its last tensor,
    including autograd's saved copies, is gone). Pass the tensors that exist before
    (parameters, inputs) as `existing`: an op that returns a view of one would otherwise
    count its storage; add their bytes yourself where they belong. Works on real, fake
    and meta tensors; only storage sizes are read. Kernel-internal workspaces are not
    seen; on a DTensor the tracker sees the local ops DTensor runs.

    `follow_resizes`: re-read every live storage's size after each op. FSDP2 frees and
    re-allocates its unsharded parameters by resizing their storages in place, which no op
    shows: without this, each layer's gathered parameters would count until the step ends.
    Costs a pass over the live storages per op, so it is for real steps of small models
    (`measure_step`), not for the estimator's probes.
    """

    def __init__(self, existing=(), fp32_grouped_mm: bool = False, follow_resizes: bool = False):
        super().__init__()
        self._follow_resizes = follow_resizes
        # fp32 grouped GEMMs get outputs on fake tensors (`_run_fp32_grouped_mm`): done here,
        # not by a mode of its own, because every extra mode costs Python on every op.
        self._run = _run_fp32_grouped_mm if fp32_grouped_mm else (lambda func, args, kwargs: func(*args, **kwargs))
        from torch.multiprocessing.reductions import StorageWeakRef
        self._ref = StorageWeakRef
        # Storage weak ref -> bytes. A weak ref keeps its StorageImpl's address from being
        # reused, so `cdata` identifies a storage while it is held here.
        self._live: dict = {}
        self._expired = torch.UntypedStorage._expired  # one C call per check (this is the hot loop)
        # Storages of `existing` (inputs, parameters) are never counted, also when an op
        # first shows them through a view (a checkpoint's detach of its saved input).
        self._existing = {self._ref(p.untyped_storage()) for t in existing for p in plain_tensors(t)}
        self.current = 0
        self.peak = 0
        self._paused = 0

    def __enter__(self):
        # DTensor infers an op's output shape by running it on fake tensors of the global
        # shape (`ShardingPropagator._propagate_tensor_meta_non_cached`, private): never memory.
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        original = ShardingPropagator._propagate_tensor_meta_non_cached

        def untracked(propagator, *args, **kwargs):
            self._paused += 1
            try:
                return original(propagator, *args, **kwargs)
            finally:
                self._paused -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = untracked
        self._restore = lambda: setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", original)
        return super().__enter__()

    def __exit__(self, *exc):
        self._restore()
        return super().__exit__(*exc)

    def _refresh(self) -> None:
        # `current` is the sum of `_live`, kept as storages come and go. Only an op that adds a
        # storage can raise the peak, so frees are collected then (and in `sample`), not after
        # every op: the peak and `current` at each of those points are the same either way.
        expired = self._expired
        gone = [key for key in self._live if expired(key.cdata)]
        for key in gone:
            self.current -= self._live.pop(key)
        if self._follow_resizes:
            storage = torch.UntypedStorage._new_with_weak_ptr
            for key in self._live:
                self._live[key] = int(storage(key.cdata).nbytes())
            self.current = sum(self._live.values())
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _has_wrapper_subclass(types):
            return NotImplemented
        out = self._run(func, args, kwargs or {})
        if self._paused:
            return out
        added = False
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                try:
                    st = t.untyped_storage()
                    key = self._ref(st)
                except Exception:  # noqa: BLE001 - storage-less tensors
                    continue
                if key not in self._live and key not in self._existing:
                    self._live[key] = int(st.nbytes())
                    self.current += self._live[key]
                    added = True
        if added or self._follow_resizes:
            self._refresh()
        return out

    def sample(self) -> int:
        """Current live bytes, after dropping the storages freed since the last op."""
        self._refresh()
        return self.current

    def reset_peak(self) -> None:
        self._refresh()
        self.peak = self.current


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard, else `t`)."""
    return t.to_local() if hasattr(t, "to_local") else t


def shard(t: torch.Tensor) -> torch.Tensor:
    """`local(t)` for reading sizes only: a DTensor's shard without `to_local()`'s autograd
    view (0.2 ms each, thousands of times per estimate of a large model)."""
    inner = getattr(t, "_local_tensor", None)
    return inner if inner is not None else local(t)


def tensor_bytes(tensors) -> int:
    return sum(shard(t).numel() * shard(t).element_size() for t in tensors)


def is_expert(name: str) -> bool:
    return ".experts." in f".{name}" or name.startswith("experts.")


def fsdp_states(module: nn.Module) -> dict[str, object]:
    """{name of the first module it wraps: FSDP state} for every FSDP unit under `module`
    (a grouped unit such as norm + output appears once)."""
    from torch.distributed.fsdp import FSDPModule

    states: dict[int, tuple[str, object]] = {}
    for name, m in module.named_modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()  # private: the one way to FSDP's parameter groups
            states.setdefault(id(state), (name, state))
    return dict(states.values())


def strip_fsdp(part: nn.Module, *modules: nn.Module) -> None:
    """Gathers the FSDP units of `modules` (of model part `part`; all of `part` if none
    given) with FSDP's all-gather (a no-op collective under the fake process group) and
    removes their forward hooks, in place: the assembly is thrown away after probing.
    The modules then compute with the gathered compute-dtype parameters, as they do
    between FSDP's pre- and post-forward. Units already stripped are left alone."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(part, FSDPModule):
        part._get_fsdp_state()._lazy_init()  # what the root's first forward does (once): comm state, units
    for module in modules or (part,):
        for state in fsdp_states(module).values():
            if getattr(state, "_stripped_for_probes", False):
                continue
            state._stripped_for_probes = True
            for group in state._fsdp_param_groups:
                group.unshard()
                group.wait_for_unshard()
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()


def use_memory_probes(part: nn.Module) -> None:
    """Switches every plan module of `part` that offers a stand-in for the estimator (a
    `memory_probe` attribute: CP's attention, see parallelisms/context_parallel.py) to it."""
    for m in part.modules():
        if hasattr(m, "memory_probe"):
            m.memory_probe = True


class BalancedDispatch:
    """Stands in for `ExpertParallelDispatcher` in probes, with balanced routing: this
    rank receives as many rows as it sends (times `receive_factor`: the busiest rank of a
    skewed routing, for the estimator's EP imbalance term), spread evenly over its E/ep
    local experts. It makes the buffers the real dispatcher makes, at those sizes: the
    received rows (dispatch all-to-all), their copy regrouped by local expert, the rows put
    back in order, and the returned rows (combine all-to-all)."""

    def __init__(self, num_local: int, receive_factor: float = 1.0):
        self.num_local = num_local
        self.receive_factor = receive_factor

    def __call__(self, experts: nn.Module, routed_input: torch.Tensor,
                 num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        n = routed_input.shape[0]
        m = max(n, round(n * self.receive_factor))  # rows received
        order = torch.arange(m, device=routed_input.device)  # the regroup permutation [m]
        base, extra = divmod(m, self.num_local)
        counts = torch.tensor([base + (i < extra) for i in range(self.num_local)], dtype=torch.int64)
        # The dispatch buffer is a temporary (not held while the experts run), as in the real dispatcher.
        out = experts((routed_input.index_select(0, order % n) if m > n else routed_input.clone())
                      .index_select(0, order), counts)
        return out.index_select(0, order)[:n].clone()


def balanced_experts(part: nn.Module, receive_factor: float = 1.0) -> None:
    """Replaces every EP dispatcher in `part` by a `BalancedDispatch` (in place)."""
    from models.common.moe import MoE

    for m in part.modules():
        if isinstance(m, MoE) and m.token_dispatcher is not None:
            m.token_dispatcher = BalancedDispatch(m.token_dispatcher.num_local, receive_factor)


def _run_fp32_grouped_mm(func, args, kwargs):
    """Runs `func`, giving `aten._grouped_mm` fake outputs for fp32 inputs as the CPU kernel
    computes them (the MoE experts run it in fp32 on CPU): torch's meta kernel, which fake
    tensors use, takes bf16 only. The output comes from the meta kernel on bf16 stand-ins,
    cast back; called inside a mode's dispatch, so no tracker sees the stand-ins."""
    if func is torch.ops.aten._grouped_mm.default and args[0].dtype == torch.float32:
        stand_in = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a
                    for a in args]
        return func(*stand_in, **kwargs).to(torch.float32)
    return func(*args, **kwargs)


def _autocast(dtype: torch.dtype | None):
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


@dataclass
class BlockProbe:
    saved: int  # bytes kept for backward (the AC module's counter)
    backward_extra: int  # peak live bytes during its backward above what forward left (incl. weight grads)
    input_bytes: int  # one residual-stream tensor, this rank's shard


def _warmed(probe):
    """Runs a probe twice and keeps the second result: an AC policy may calibrate itself on
    a block's first call (and first calls fill caches); the second call is what every
    later training step sees."""
    def run(*args, **kwargs):
        probe(*args, **kwargs)
        return probe(*args, **kwargs)

    run.__doc__ = probe.__doc__
    run.once = probe  # one call: for a policy that does not calibrate (see EstimateCache)
    return run


@_warmed
def probe_block(block: nn.Module, rope: torch.Tensor, *, input_shape: tuple, dtype: torch.dtype,
                autocast: torch.dtype | None = None, constants=()) -> BlockProbe:
    """Runs an assembled block (under its fake mode, after `strip_fsdp`) forward and
    backward on a residual input of `input_shape` in `dtype` (forward under `autocast`
    if given). `rope`: the RoPE rows the model passes to its blocks. `constants`: what
    the block reads but does not own (the RoPE table and its cast), not counted here."""
    from parallelisms.ac_measure import SavedActivationCounter

    block.zero_grad(set_to_none=True)
    x = torch.empty(input_shape, dtype=dtype, requires_grad=True)
    exclude = list(block.parameters()) + list(block.buffers()) + list(constants)
    with LiveBytesTracker([x, rope, *exclude], fp32_grouped_mm=True) as tracker:
        with SavedActivationCounter(exclude) as counter, _autocast(autocast):
            out = local(block(x, rope))
        grad_out = torch.empty_like(out)
        after_forward = tracker.sample()
        tracker.reset_peak()
        out.backward(grad_out)
        peak = tracker.peak
    return BlockProbe(saved=counter.total_bytes, backward_extra=int(peak - after_forward),
                      input_bytes=x.numel() * x.element_size())


@dataclass
class HeadProbe:
    saved: int  # kept for backward by final norm + output + loss
    forward_peak: int  # peak live bytes in its forward (incl. its input hidden state)
    backward_peak: int  # peak in its backward (saved + grads + temporaries, incl. input)
    weight_grad_bytes: int


@_warmed
def probe_head(part: nn.Module, *, chunked: bool, input_shape: tuple, labels_shape: tuple, dtype: torch.dtype,
               autocast: torch.dtype | None = None, loss_parallel: bool = False) -> HeadProbe:
    """The assembled final norm + output head + the trainer's loss, forward and backward,
    under the step's context (loss parallel under TP, autocast without FSDP). `chunked`:
    the head (then a `LinearCrossEntropyHead`) computes the loss chunk by chunk; else it
    returns the logits, as a plain Linear does."""
    from parallelisms.ac_measure import SavedActivationCounter
    from trainer.loss import TokenNormalizedLoss

    norm, head = part.norm, part.output
    norm.zero_grad(set_to_none=True)
    head.zero_grad(set_to_none=True)
    loss_fn = TokenNormalizedLoss(chunked_ce=chunked)
    params = list(norm.parameters()) + list(head.parameters())
    x = torch.empty(input_shape, dtype=dtype, requires_grad=True)
    labels = torch.zeros(labels_shape, dtype=torch.long)
    x_bytes = x.numel() * x.element_size()
    with contextlib.ExitStack() as step:
        if loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_ctx

            step.enter_context(loss_parallel_ctx())
        step.enter_context(loss_fn.normalized_by(torch.ones((), dtype=torch.float32)))
        with LiveBytesTracker([x, *params]) as tracker:
            with SavedActivationCounter(params) as counter, _autocast(autocast):
                h = norm(x)
                loss = loss_fn(head(h, labels) if chunked else head(h), labels)
                del h
            forward_peak = tracker.peak
            tracker.reset_peak()
            loss.backward()
            backward_peak = tracker.peak
            del loss
    return HeadProbe(saved=counter.total_bytes, forward_peak=forward_peak + x_bytes,
                     backward_peak=backward_peak + x_bytes, weight_grad_bytes=tensor_bytes(params))
