"""Distributed checkpoints (torch.distributed.checkpoint): what is saved, when, and how a
bad checkpoint is reported.

What a save holds: model, optimizer, LR schedule, step, every rank's RNG and every data
rank's loader position, so a resume is bitwise exact. How it reaches disk safely (a commit
point, atomic replacement, checksums, repair after a crash) is trainer/checkpoint_files.py.

Async saves write in a background thread and are committed at the first step boundary
where every rank's write has finished (`step_boundary`, whose flag rides on the per-step
loss all-reduce), not at the next save: a crash after that boundary loses nothing
that was written.

Every way a checkpoint can be unreadable (missing .metadata, a truncated, empty, deleted
or flipped .distcp, another model's tensors, DCP's CheckpointException, which is a
BaseException and slips past `except Exception`) ends as one CheckpointError line that
names the folder and the way out: `--checkpoint.load_step N`, or delete it.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer import checkpoint_files as files
from trainer.checkpoint_files import CheckpointError, choose_resume, list_checkpoints, refusal  # noqa: F401
from trainer.checkpoint_staging import CachedStager
from configuration.fields import ConfigError
from trainer.checkpoint_config import CheckpointConfig, check_checkpoint_paths, checkpoint_folder
from configuration.environment import global_rank
from trainer.distributed import collective_timeout, exempt_from_train_timeout

logger = logging.getLogger("trainer")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _first_line(e: BaseException) -> str:
    """The root message of an exception, CheckpointException's per-rank ones included."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = f"{type(e).__name__}: {e}"
    return text.strip().splitlines()[0][:240] if text.strip() else type(e).__name__


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer with the `async_write` crash point between the data and the metadata."""

    def __init__(self, path: Path, step: int):
        super().__init__(str(path))
        self._step = step

    def write_data(self, plan, planner):
        result = super().write_data(plan, planner)
        files.crash_point("async_write", self._step)
        return result


@dataclass
class _PendingSave:
    done: Future  # the write, then this rank's checksums
    tmp: Path
    final: Path
    step: int


class Checkpointer:
    """Saves and restores the whole training state with torch.distributed.checkpoint."""

    def __init__(self, cfg: CheckpointConfig, dump_folder: str, *, model_parts: list[torch.nn.Module],
                 optimizers: list[torch.optim.Optimizer], lr_schedulers: list, dataloader: Any, dp_rank: int,
                 writer: str | None = None):
        """`writer`: this job's name among several that share the folder (a torchft replica group,
        "replica-<id>"): its temporary folders carry it, and its start repairs only those."""
        self.cfg = cfg
        self.writer = writer
        self.folder = checkpoint_folder(cfg, dump_folder)
        self.model_parts, self.optimizers, self.lr_schedulers = model_parts, optimizers, lr_schedulers
        self.dataloader, self.dp_rank = dataloader, dp_rank
        self._pending: _PendingSave | None = None
        self._flagged: _PendingSave | None = None  # the pending save this step's busy flag is about
        self._saved_step: int | None = None  # the newest full save started (pending or committed)
        self._reading: Path | None = None  # the checkpoint being loaded
        self._executor: ThreadPoolExecutor | None = None
        self._stager = None  # trainer/checkpoint_staging.py: cached (pinned on CUDA) host buffers
        self.last_save_seconds = 0.0
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one probe per node (node-local or shared disks)
            check_checkpoint_paths(cfg, dump_folder)
        # Async saves run collectives from a background thread; give them their own group.
        self._async_pg = None
        if cfg.enable and cfg.async_mode == "async" and dist.is_initialized():
            self._async_pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.timeout_seconds))
            exempt_from_train_timeout(self._async_pg)

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
        rank = global_rank()
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

    def _export_model_state(self) -> dict[str, Any]:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.cfg.export_dtype]
        return {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in self._model_state().items()}

    # ---- save ----
    def should_save(self, step: int, last_step: bool) -> bool:
        if last_step and self.cfg.last_save_in_hf:
            return True
        return self.cfg.enable and (step % self.cfg.interval == 0 or last_step)

    def save(self, step: int, *, last_step: bool = False, force_sync: bool = False) -> None:
        """Saves step `step`. A second call for a step already saved (a preemption right after
        an interval save) only finishes that save."""
        with collective_timeout(self.cfg.timeout_seconds):
            self._save(step, last_step=last_step, force_sync=force_sync)

    def _save(self, step: int, *, last_step: bool, force_sync: bool) -> None:
        if last_step and self.cfg.last_save_in_hf:
            self.save_hf(step)
        if not self.cfg.enable:
            return
        if last_step and self.cfg.last_save_model_only:
            return self._save_model_only(step)
        if step == self._saved_step:
            return self.wait()
        self.wait()
        tmp, final = self._begin(step)
        state = self._full_state(step)
        t0 = time.perf_counter()
        if self.cfg.async_mode == "async" and not force_sync and not last_step:
            self._saved_step = step
            self._start_async(state, tmp, final, step)
        else:
            self._write(state, tmp, step)
            self._saved_step = step
            self._commit(tmp, final, step, "full", files.checksum_files(files.rank_files(tmp, global_rank())))
        self.last_save_seconds = time.perf_counter() - t0

    def save_model_only(self, step: int) -> None:
        """Writes step-N with model weights only (a seed checkpoint or an export)."""
        with collective_timeout(self.cfg.timeout_seconds):
            self._save_model_only(step)

    def _save_model_only(self, step: int) -> None:
        self.wait()
        tmp, final = self._begin(step)
        self._write({"model": self._export_model_state()}, tmp, step)
        self._commit(tmp, final, step, "model", files.checksum_files(files.rank_files(tmp, global_rank())))

    def _begin(self, step: int) -> tuple[Path, Path]:
        final = self.folder / f"step-{step}"
        tmp = files.temp_folder(final, self.writer)
        if global_rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        return tmp, final

    def _write(self, state: dict[str, Any], tmp: Path, step: int) -> None:
        try:
            dcp.save(state, storage_writer=_Writer(tmp, step))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
            raise self._save_failed(tmp, step, e) from None

    def _start_async(self, state: dict[str, Any], tmp: Path, final: Path, step: int) -> None:
        self._stager = self._stager or CachedStager()  # host buffers allocated once, reused by every save
        future = dcp.async_save(state, storage_writer=_Writer(tmp, step), process_group=self._async_pg,
                                async_stager=self._stager)
        rank = global_rank()

        def finish() -> dict[str, dict]:
            future.result()
            return files.checksum_files(files.rank_files(tmp, rank))

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")
        self._pending = _PendingSave(self._executor.submit(finish), tmp, final, step)

    def _save_failed(self, tmp: Path, step: int, e: BaseException) -> CheckpointError:
        """Removes the partial save and names the cause (a full disk shows up as
        `inline_container.cc: unexpected pos`, so the free space is checked here)."""
        from trainer.errors import disk_error_message

        cause = e
        if isinstance(e, CheckpointException) and e.failures:
            cause = next(iter(e.failures.values()))[0]
        line = disk_error_message(cause, f"checkpoint error: saving step-{step} to {self.folder} failed") \
            if isinstance(cause, OSError) else None
        if line is None:
            try:
                free = shutil.disk_usage(self.folder).free
            except OSError:
                free = None
            if free is not None and free < 64 * 2**20:
                line = (f"checkpoint error: saving step-{step} to {self.folder} failed: no space left on the device "
                        f"({free / 2**20:.1f} MiB free); free space, lower checkpoint.keep_latest_k, or point "
                        "checkpoint.folder at a bigger disk")
        if global_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointError(line or f"checkpoint error: saving step-{step} to {self.folder} failed "
                                       f"({_first_line(e)}); the partial save was removed")

    def _commit(self, tmp: Path, final: Path, step: int, kind: str, my_files: dict | str) -> None:
        """Collective: the commit point (rank 0 writes the manifest of every rank's files), then
        the atomic replace. `my_files` is this rank's checksums, or its write error."""
        files.crash_point("after_write", step)
        gathered = _all_gather(my_files)
        errors = [g for g in gathered if isinstance(g, str)]
        if errors:
            if global_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(errors[0])
        if global_rank() == 0:
            merged = {name: entry for g in gathered for name, entry in g.items()}
            files.write_manifest(tmp, merged, step=step, kind=kind)
            files.crash_point("before_rename", step)
            files.replace(tmp, final, step, self.writer)
            self._purge()
        _barrier()

    def write_finished(self) -> bool:
        """This rank's part of the pending async save is on disk (no collective)."""
        return self._pending is not None and self._pending.done.done()

    def has_pending(self) -> bool:
        return self._pending is not None

    def commit_pending(self) -> None:
        """Collective: commits the pending async save; call when every rank's write has finished."""
        with collective_timeout(self.cfg.timeout_seconds):
            self._commit_pending()

    def _commit_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            result: dict | str = pending.done.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            result = str(self._save_failed(pending.tmp, pending.step, e))
        self._commit(pending.tmp, pending.final, pending.step, "full", result)
        logger.info(f"checkpoint step-{pending.step} committed (async)")

    def boundary_busy_flag(self) -> float:
        """1.0 while this rank still writes the pending async save; summed over ranks in the step's
        loss all-reduce. Remembers the save it is about: a later one is not committed on its behalf."""
        self._flagged = self._pending
        return float(self._pending is not None and not self.write_finished())

    def step_boundary(self, any_busy: bool, step: int) -> None:
        """Commits the pending async save if no rank was writing it at this step's all-reduce."""
        if self._pending is not None and self._pending is self._flagged and not any_busy:
            self.commit_pending()
        files.crash_point("step_end", step)

    def wait(self) -> None:
        """Finishes and commits a pending async save (before the next save and at close)."""
        if self._pending is not None:
            self.commit_pending()  # waits for this rank's write; a failed write is reported there

    def _purge(self) -> None:
        """keep_latest_k counts full training states only: a model-only export never pushes out
        the state a resume needs."""
        if self.cfg.keep_latest_k > 0:
            full = [p for _, p in list_checkpoints(self.folder) if files.kind_of(p) == "full"]
            for path in full[: -self.cfg.keep_latest_k]:
                shutil.rmtree(path, ignore_errors=True)

    # ---- load ----
    def resume_path(self) -> Path | None:
        return choose_resume(self.folder, self.cfg.load_step)

    def _refuse(self, path: Path, why: str, damaged: bool = False) -> CheckpointError:
        return refusal(self.folder, path, why, damaged)

    def _verify(self, path: Path) -> None:
        """Collective: each rank checks its share of the files against the manifest."""
        manifest = files.read_manifest(path)
        problem = None
        if manifest is not None and self.cfg.verify_on_load:
            names = sorted(manifest["files"])
            world = dist.get_world_size() if dist.is_initialized() else 1  # each rank verifies 1/world of the files
            problem = files.verify_files(path, manifest, names[global_rank()::world])
        problems = [p for p in _all_gather(problem) if p]
        if problems:
            raise self._refuse(path, f"is damaged: {problems[0]}", damaged=True)

    def _check_model_matches(self, path: Path, metadata, model_sd: dict[str, Any]) -> None:
        saved = metadata.state_dict_metadata
        missing = [k for k in model_sd if f"model.{k}" not in saved]
        wrong = [(k, list(saved[f"model.{k}"].size), list(v.shape)) for k, v in model_sd.items()
                 if f"model.{k}" in saved and hasattr(saved[f"model.{k}"], "size")
                 and tuple(saved[f"model.{k}"].size) != tuple(v.shape)]
        if missing or wrong:
            detail = (f"{wrong[0][0]} is {wrong[0][1]} there, {wrong[0][2]} here" if wrong else
                      f"{len(missing)} of this model's tensors are missing there, e.g. {missing[0]}")
            raise self._refuse(path, f"holds another model ({detail}; another model or flavor?)")

    def _read_metadata(self, path: Path):
        try:
            return dcp.FileSystemReader(str(path)).read_metadata()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failure: unreadable metadata
            raise self._refuse(path, f"has unreadable metadata ({_first_line(e)})", damaged=True) from None

    def load(self) -> int:
        """Restores the newest complete checkpoint (or initial_load_path); returns the step to continue from.
        on_corrupt = "fallback": damage (found before any load, alike on every rank: names and sizes,
        or the all-gathered checksums) is set aside as step-N.corrupt and the one before loaded."""
        if self.cfg.enable:
            if global_rank() == 0:
                for note in files.recover(self.folder, self.writer):
                    logger.info(f"checkpoint: {note}")
            _barrier()
        while True:
            try:
                return self._load_newest()
            except CheckpointError as e:
                if self._superseded():
                    continue
                if not files.falls_back(self.folder, e, self.cfg.on_corrupt, self.cfg.load_step):
                    raise
                _barrier()  # every rank has looked at the folder before it moves
                if global_rank() == 0:
                    path, why = e.damaged
                    aside = files.set_aside(path)
                    logger.warning(f"checkpoint: {path} {why}; moved it to {aside.name} and resuming from the newest "
                                   "complete checkpoint before it (checkpoint.on_corrupt = fallback)")
                _barrier()

    def _superseded(self) -> bool:
        """Collective: the checkpoint this group failed to read was replaced by a newer one meanwhile.
        Several writers (replica groups) share the folder: a live group may commit a save and purge
        the oldest (keep_latest_k) while a restarting group reads it; then the newest is read again."""
        failed = self._reading
        if self.writer is None or failed is None or self.cfg.load_step >= 0:
            return False
        try:
            newer = self.resume_path() not in (None, failed)
        except CheckpointError:
            newer = False
        if not any(_all_gather(newer)):
            return False
        if global_rank() == 0:
            logger.warning(f"checkpoint: {failed.name} was replaced by a newer save of another replica group while "
                           "this group read it; reading the newest")
        return True

    def _load_newest(self) -> int:
        path = self.resume_path() if self.cfg.enable else None
        self._reading = path
        if path is None:
            if self.cfg.initial_load_path and not self.cfg.initial_load_in_hf:
                self.load_model_only(Path(self.cfg.initial_load_path))
            elif self.cfg.initial_load_path:
                self.load_hf(Path(self.cfg.initial_load_path))
            return 0
        if self.cfg.initial_load_path and global_rank() == 0:
            logger.info(f"resuming from {path}; checkpoint.initial_load_path is used only when there is none")
        self._verify(path)
        metadata = self._read_metadata(path)
        top = {k.split(".", 1)[0] for k in metadata.state_dict_metadata}
        if "optimizer" not in top:
            # A model-only checkpoint (a seed or an export): weights only, training starts at step 0.
            self.load_model_only(path, verified=True)
            return 0
        state = self._full_state(0)
        self._check_model_matches(path, metadata, state["model"])
        state = {k: v for k, v in state.items() if k in top}
        dl_key = f"dataloader_dp{self.dp_rank}"
        saved_slices = sorted(int(k.removeprefix("dataloader_dp")) for k in top if k.startswith("dataloader_dp"))
        if self.dataloader is not None and dl_key not in top and saved_slices:
            # No state of this rank's own: more data-parallel ranks than were saved, or a replica group
            # that was away when another group saved. Every slice's position is the same global batch
            # index, which the loader maps to this rank's slice: take the lowest one saved.
            dl_key = f"dataloader_dp{saved_slices[0]}"
            state[dl_key] = self.dataloader.state_dict()
        self._dcp_load(state, path)
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        for part, optimizer in zip(self.model_parts, self.optimizers):
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, optimizer, state["optimizer"], options=opts)
        for sched in self.lr_schedulers:
            if "lr_scheduler" in state:
                sched.load_state_dict(state["lr_scheduler"])
        rng = state.get(f"rng_rank{global_rank()}")
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if rng.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        if self.dataloader is not None and dl_key in state:
            self.dataloader.load_state_dict(state[dl_key])
        self._saved_step = int(state["train_state"]["step"])
        return self._saved_step

    def _dcp_load(self, state: dict[str, Any], path: Path) -> None:
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
            raise self._refuse(path, f"could not be loaded ({_first_line(e)})") from None

    def load_model_only(self, path: Path, verified: bool = False) -> None:
        if not files.is_complete(path):
            raise ConfigError(f"config error: checkpoint.initial_load_path: {path} is not a DCP checkpoint folder "
                              "(no .metadata); point it at a step-N folder, or set initial_load_in_hf for HF weights")
        if not verified:
            self._verify(path)
        model_sd = self._model_state()
        self._check_model_matches(path, self._read_metadata(path), model_sd)
        self._dcp_load({"model": model_sd}, path)
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
        if self._executor is not None:
            self._executor.shutdown(wait=True)
