"""What a restarted replica group copies from a live peer: everything a step depends on.

torchft's transport pairs group rank r of the healing group with group rank r of a live
group, and every group has the same layout, so each rank sends its *local* shards as plain
tensors (no DTensor over the wire) and the receiver copies them into its own shards:
bitwise the peer's values. Optimizer state that does not exist yet on the receiver (a fresh
process has taken no step) is rebuilt as DTensors with its parameter's spec.

The payload: parameters and buffers of every model part, every optimizer's state and param
groups (the learning rate the next step uses is there), the LR schedules, the step, the data
position (global, so the peer's is this group's too: see trainer/data/stream.py), the RNG
and the step guard's history.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def tensors_of(part: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*part.named_parameters(), *part.named_buffers()]


def _optimizer_state(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Per parameter (in param_groups order): {state key: local tensor or value}."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            out.append({k: (_local(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()})
    return out


def _load_optimizer_state(opt: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    params = [p for group in opt.param_groups for p in group["params"]]
    if len(params) != len(saved):
        raise RuntimeError(f"heal: the peer's optimizer has {len(saved)} parameters, this one {len(params)}")
    for p, values in zip(params, saved):
        state = opt.state.setdefault(p, {})
        for key, value in values.items():
            if not isinstance(value, torch.Tensor):
                state[key] = value
                continue
            mine = state.get(key)
            if mine is not None:
                _local(mine).copy_(value)
            elif isinstance(p, DTensor) and value.shape == p._local_tensor.shape and value.dim() > 0:
                # A moment buffer shaped like the parameter: the same sharding as the parameter.
                state[key] = DTensor.from_local(value.to(p.device).clone(), p.device_mesh, p.placements,
                                                run_check=False, shape=p.shape, stride=p.stride())
            elif value.dim() > 0:
                state[key] = value.to(_local(p).device).clone()
            else:  # a step counter: on the device only for fused/capturable optimizers
                on_device = opt.defaults.get("fused") or opt.defaults.get("capturable")
                state[key] = value.to(_local(p).device).clone() if on_device else value.clone()


def capture(trainer) -> dict[str, Any]:
    """This rank's share of the trainer's state at a step boundary (references, not copies: the
    sender keeps them unchanged until its should-commit, which waits for the transfer)."""
    return {
        "step": trainer.step,
        "model": [[t.detach() if not isinstance(t, DTensor) else t._local_tensor.detach()
                   for _, t in tensors_of(part)] for part in trainer.model_parts],
        "optimizers": [_optimizer_state(o) for o in trainer.optimizers],
        # The rate the next step uses lives in the param groups (the schedule writes it there on its step).
        "param_groups": [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
                         for o in trainer.optimizers],
        "lr_schedulers": [s.state_dict() for s in trainer.lr_schedulers],
        "data": trainer.dataloader.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available()
                else None, "numpy": np.random.get_state(), "python": random.getstate()},
        "guard": {"history": list(trainer.guard.history), "consecutive": trainer.guard.consecutive,
                  "total_skipped": trainer.guard.total_skipped},
    }


@torch.no_grad()
def restore(trainer, state: dict[str, Any]) -> None:
    """Loads a peer's `capture` into this trainer (same layout: shards line up one to one)."""
    for part, saved in zip(trainer.model_parts, state["model"], strict=True):
        mine = tensors_of(part)
        if len(mine) != len(saved):
            raise RuntimeError(f"heal: the peer's model part has {len(saved)} tensors, this one {len(mine)}")
        for (name, t), value in zip(mine, saved):
            local = _local(t)
            if local.shape != value.shape:
                raise RuntimeError(f"heal: {name} is {tuple(local.shape)} here but {tuple(value.shape)} at the peer")
            local.copy_(value)
    for opt, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
        _load_optimizer_state(opt, saved)
    for opt, groups in zip(trainer.optimizers, state["param_groups"], strict=True):
        for group, saved in zip(opt.param_groups, groups, strict=True):
            group.update(saved)
    for sched, saved in zip(trainer.lr_schedulers, state["lr_schedulers"], strict=True):
        sched.load_state_dict(saved)
    trainer.dataloader.load_state_dict(state["data"])
    trainer.data_iter = iter(trainer.dataloader)  # continue from the peer's (global) position
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    guard = state["guard"]
    trainer.guard.history = deque(guard["history"], maxlen=trainer.guard.history.maxlen)
    trainer.guard.consecutive, trainer.guard.total_skipped = guard["consecutive"], guard["total_skipped"]
    trainer.step = int(state["step"])
