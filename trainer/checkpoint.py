"""Distributed checkpoints (torch.distributed.checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.configurable import ConfigError, opt


@dataclass
class CheckpointConfig:
    """[checkpoint]: DCP checkpoints in <dump_folder>/<folder>/step-N."""

    enable: bool = opt(False, "Save checkpoints and resume from the newest complete one.")
    folder: str = opt("checkpoint", "Checkpoint folder, relative to job.dump_folder (or absolute).")
    interval: int = opt(500, "Save every N steps (the last step is always saved).", min=1)
    keep_latest_k: int = opt(0, "Keep only the newest K checkpoints; 0 keeps all.", min=0)
    async_mode: str = opt("disabled", "disabled, or async (save in a background thread).",
                          choices=("disabled", "async"))
    last_save_model_only: bool = opt(False, "Make the final checkpoint hold only model weights (an export).")
    load_step: int = opt(-1, "Resume from this step instead of the newest; -1 = newest.", min=-1)
    initial_load_path: str | None = opt(None, "Weights to start from when no checkpoint exists in folder "
                                        "(a DCP step folder, or an HF folder with initial_load_in_hf).")
    initial_load_in_hf: bool = opt(False, "initial_load_path is a Hugging Face safetensors folder.")
    last_save_in_hf: bool = opt(False, "Also export the final weights as a Hugging Face folder.")
    export_dtype: str = opt("float32", "dtype of exported weights.", choices=("float32", "bfloat16", "float16"))
    create_seed_checkpoint: bool = opt(False, "Initialise the model in one process, save it as step-0 and exit. "
                                       "Runs on any layout that then start from it begin with identical weights.")

    def validate(self, root) -> None:
        if self.create_seed_checkpoint and not self.enable:
            raise ConfigError("config error: checkpoint.create_seed_checkpoint needs checkpoint.enable = true")


import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """An unreadable or mismatching checkpoint; one line naming the path and the fix."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints only: `step-N` folders (temporaries have another name) with DCP metadata."""
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / ".metadata").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


class Checkpointer:
    """Saves and restores the whole training state with torch.distributed.checkpoint.

    A save goes to `step-N.tmp` and is renamed to `step-N` by rank 0 only after
    every rank has finished writing, so a crash mid-save leaves the previous
    checkpoint as the newest complete one. Resume picks the newest complete one.
    """

    def __init__(self, cfg: CheckpointConfig, dump_folder: str, *, model_parts: list[torch.nn.Module],
                 optimizers: list[torch.optim.Optimizer], lr_schedulers: list, dataloader: Any, dp_rank: int):
        self.cfg = cfg
        self.folder = Path(cfg.folder) if os.path.isabs(cfg.folder) else Path(dump_folder) / cfg.folder
        self.model_parts, self.optimizers, self.lr_schedulers = model_parts, optimizers, lr_schedulers
        self.dataloader, self.dp_rank = dataloader, dp_rank
        self._pending: tuple[Any, Path, Path] | None = None
        # Async saves run collectives from a background thread; give them their own group.
        self._async_pg = None
        if cfg.enable and cfg.async_mode == "async" and dist.is_initialized():
            self._async_pg = dist.new_group(backend="gloo")

    # ---- state ----
    def _model_state(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for part in self.model_parts:
            sd.update(get_model_state_dict(part))
        return sd

    def _optimizer_state(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        for part, optimizer in zip(self.model_parts, self.optimizers):
            sd.update(get_optimizer_state_dict(part, optimizer, options=opts))
        return sd

    def _full_state(self, step: int) -> dict[str, Any]:
        rank = _rank()
        state: dict[str, Any] = {
            "model": self._model_state(),
            "optimizer": self._optimizer_state(),
            "lr_scheduler": self.lr_schedulers[0].state_dict() if self.lr_schedulers else {},
            "train_state": {"step": step},
            # Per-rank keys: DCP de-duplicates identical keys across ranks.
            f"rng_rank{rank}": {"cpu": torch.get_rng_state(),
                                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
        }
        if self.dataloader is not None:
            state[f"dataloader_dp{self.dp_rank}"] = self.dataloader.state_dict()
        return state

    # ---- save ----
    def should_save(self, step: int, last_step: bool) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or last_step)

    def save(self, step: int, *, last_step: bool = False, force_sync: bool = False) -> None:
        if not self.cfg.enable:
            return
        if last_step and self.cfg.last_save_in_hf:
            self.save_hf(step)
        if last_step and self.cfg.last_save_model_only:
            return self.save_model_only(step)
        self.wait()
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        if _rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        state = self._full_state(step)
        t0 = time.perf_counter()
        if self.cfg.async_mode == "async" and not force_sync and not last_step:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_pg)
            self._pending = (future, tmp, final)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self._commit(tmp, final)
        self.last_save_seconds = time.perf_counter() - t0

    def save_model_only(self, step: int) -> None:
        """Writes step-N with model weights only (a seed checkpoint or an export)."""
        self.wait()
        final, tmp = self.folder / f"step-{step}", self.folder / f"step-{step}.tmp"
        if _rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        dcp.save({"model": self._export_model_state()}, checkpoint_id=str(tmp))
        self._commit(tmp, final)

    def _export_model_state(self) -> dict[str, Any]:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.cfg.export_dtype]
        return {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in self._model_state().items()}

    def _commit(self, tmp: Path, final: Path) -> None:
        _barrier()
        if _rank() == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._purge()
        _barrier()

    def wait(self) -> None:
        """Finishes a pending async save (called before the next save and at close)."""
        if self._pending is None:
            return
        future, tmp, final = self._pending
        self._pending = None
        future.result()
        self._commit(tmp, final)

    def _purge(self) -> None:
        if self.cfg.keep_latest_k > 0:
            for _, path in list_checkpoints(self.folder)[: -self.cfg.keep_latest_k]:
                shutil.rmtree(path, ignore_errors=True)

    # ---- load ----
    def resume_path(self) -> Path | None:
        ckpts = list_checkpoints(self.folder)
        if self.cfg.load_step >= 0:
            match = [p for s, p in ckpts if s == self.cfg.load_step]
            if not match:
                raise ConfigError(f"config error: checkpoint.load_step: no complete checkpoint step-"
                                  f"{self.cfg.load_step} in {self.folder}; available: {[s for s, _ in ckpts]}")
            return match[0]
        return ckpts[-1][1] if ckpts else None

    def load(self) -> int:
        """Restores the newest complete checkpoint (or initial_load_path); returns the step to continue from."""
        if not self.cfg.enable:
            return 0
        path = self.resume_path()
        if path is None:
            if self.cfg.initial_load_path and not self.cfg.initial_load_in_hf:
                self.load_model_only(Path(self.cfg.initial_load_path))
            elif self.cfg.initial_load_path:
                self.load_hf(Path(self.cfg.initial_load_path))
            return 0
        try:
            keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        except Exception as e:  # noqa: BLE001 - any failure here means the metadata is unreadable
            raise CheckpointError(f"checkpoint error: {path} has unreadable metadata ({type(e).__name__}); delete "
                                  "it to resume from the previous one, or set --checkpoint.load_step") from None
        top = {k.split(".", 1)[0] for k in keys}
        if "optimizer" not in top:
            # A model-only export: weights only, training starts at step 0.
            self.load_model_only(path)
            return 0
        state = self._full_state(0)
        state = {k: v for k, v in state.items() if k in top}
        dl_key = f"dataloader_dp{self.dp_rank}"
        if self.dataloader is not None and dl_key not in top and "dataloader_dp0" in top:
            # Resuming onto more data-parallel ranks than were saved: this rank has no state of its
            # own. dp rank 0's position is a global batch index, which the loader remaps to this rank.
            dl_key = "dataloader_dp0"
            state[dl_key] = self.dataloader.state_dict()
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint error: {path} could not be loaded ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200]}); delete it or set --checkpoint.load_step") from None
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        for part, optimizer in zip(self.model_parts, self.optimizers):
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, optimizer, state["optimizer"], options=opts)
        for sched in self.lr_schedulers:
            if "lr_scheduler" in state:
                sched.load_state_dict(state["lr_scheduler"])
        rng = state.get(f"rng_rank{_rank()}")
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if rng.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        if self.dataloader is not None and dl_key in state:
            self.dataloader.load_state_dict(state[dl_key])
        return int(state["train_state"]["step"])

    def load_model_only(self, path: Path) -> None:
        if not (path / ".metadata").is_file():
            raise ConfigError(f"config error: checkpoint.initial_load_path: {path} is not a DCP checkpoint folder "
                              "(no .metadata); point it at a step-N folder, or set initial_load_in_hf for HF weights")
        model_sd = self._model_state()
        try:
            dcp.load({"model": model_sd}, checkpoint_id=str(path))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint error: {path} could not be loaded ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200]})") from None
        for part in self.model_parts:
            set_model_state_dict(part, model_sd, options=StateDictOptions(strict=False))

    # ---- Hugging Face (trainer/hf_io.py) ----
    def load_hf(self, path: Path) -> None:
        """Loads an HF safetensors folder (initial_load_in_hf); each rank reads only its shards."""
        from models.hf_config import HFConfigError
        from trainer.hf_io import load_hf_into_model

        try:
            load_hf_into_model(self.model_parts, path)
        except HFConfigError as e:
            raise CheckpointError("checkpoint error: checkpoint.initial_load_path: " + str(e).removeprefix("hf error: ")) from None

    def save_hf(self, step: int) -> None:
        """Exports the weights as an HF folder <folder>/step-N-hf in export_dtype (last_save_in_hf)."""
        from trainer.hf_io import DTYPES, save_hf

        self.wait()
        save_hf(self.model_parts, self.folder / f"step-{step}-hf", dtype=DTYPES[self.cfg.export_dtype])

    def close(self) -> None:
        self.wait()
