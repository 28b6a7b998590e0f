"""[checkpoint]: the config section and the checks that run before any worker starts.

Apart from trainer/checkpoint.py so that the config root and the pre-launch check read the
section and test its paths without importing torch.distributed.checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from configuration.fields import ConfigError, opt
from trainer import checkpoint_files as files
from trainer.checkpoint_files import CheckpointError, choose_resume


@dataclass
class CheckpointConfig:
    """[checkpoint]: DCP checkpoints in <dump_folder>/<folder>/step-N."""

    enable: bool = opt(False, "Save checkpoints and resume from the newest complete one.")
    folder: str = opt("checkpoint", "Checkpoint folder, relative to job.dump_folder (or absolute).")
    interval: int = opt(500, "Save every N steps (the last step is always saved).", min=1)
    keep_latest_k: int = opt(0, "Keep only the newest K full training states (model-only exports are kept); "
                             "0 keeps all.", min=0)
    async_mode: str = opt("disabled", "disabled, or async (save in a background thread; committed at the first "
                          "step boundary after every rank has finished writing).", choices=("disabled", "async"))
    last_save_model_only: bool = opt(False, "Make the final checkpoint hold only model weights (an export); the "
                                     "newest full training state is kept for resuming.")
    load_step: int = opt(-1, "Resume from this step instead of the newest; -1 = newest.", min=-1)
    initial_load_path: str | None = opt(None, "Weights to start from when no checkpoint exists in folder "
                                        "(a DCP step folder, or an HF folder with initial_load_in_hf); works "
                                        "with checkpoint.enable = false too.")
    initial_load_in_hf: bool = opt(False, "initial_load_path is a Hugging Face safetensors folder.")
    last_save_in_hf: bool = opt(False, "Also export the final weights as a Hugging Face folder <folder>/step-N-hf "
                                "(works with checkpoint.enable = false too).")
    export_dtype: str = opt("float32", "dtype of exported weights.", choices=("float32", "bfloat16", "float16"))
    create_seed_checkpoint: bool = opt(False, "Initialise the model in one process, save it as step-0 and exit. "
                                       "Runs on any layout that then start from it begin with identical weights.")
    timeout_seconds: int = opt(1800, "Collective timeout while a checkpoint is saved or committed (after step 1 "
                               "the others drop to comm.train_timeout_seconds, too short for a large save).", min=1)
    on_corrupt: str = opt("stop", "A damaged newest checkpoint (missing, truncated or checksum-failing files, "
                          "unreadable metadata) at start-up: stop (one line, exit 2), or fallback (rename it to "
                          "step-N.corrupt, log one line, resume from the complete one before it; for requeued "
                          "jobs).", choices=("stop", "fallback"))
    verify_on_load: bool = opt(True, "Check every file against the CRC32 manifest written at save before loading "
                               "(each rank reads its share once; see scripts/bench_checkpoint.py for the cost).")

    def validate(self, root) -> None:
        needs_enable = {"create_seed_checkpoint": self.create_seed_checkpoint, "load_step": self.load_step >= 0,
                        "last_save_model_only": self.last_save_model_only}
        for key, used in needs_enable.items():
            if used and not self.enable:
                raise ConfigError(f"config error: checkpoint.{key} needs checkpoint.enable = true; "
                                  "pass --checkpoint.enable true")
        if self.initial_load_in_hf and not self.initial_load_path:
            raise ConfigError("config error: checkpoint.initial_load_in_hf needs checkpoint.initial_load_path (the "
                              "Hugging Face folder to load); pass --checkpoint.initial_load_path <folder>")


def checkpoint_folder(cfg: CheckpointConfig, dump_folder: str) -> Path:
    return Path(cfg.folder) if os.path.isabs(cfg.folder) else Path(dump_folder) / cfg.folder


def check_checkpoint_paths(cfg: CheckpointConfig, dump_folder: str) -> None:
    """Before step 1: the checkpoint folder is writable and initial_load_path exists."""
    from trainer.errors import check_writable_folder

    if cfg.enable or cfg.last_save_in_hf:
        check_writable_folder(checkpoint_folder(cfg, dump_folder), "checkpoint.folder")
    if cfg.enable:
        try:
            choose_resume(checkpoint_folder(cfg, dump_folder), cfg.load_step)
        except CheckpointError as e:  # fallback: the workers set it aside (Checkpointer.load), not this check
            if not files.falls_back(checkpoint_folder(cfg, dump_folder), e, cfg.on_corrupt, cfg.load_step):
                raise
    path = cfg.initial_load_path
    if path and not os.path.isdir(path):
        raise ConfigError(f"config error: checkpoint.initial_load_path: {path} is not a folder; point it at a "
                          "DCP step-N folder, or a Hugging Face folder with --checkpoint.initial_load_in_hf true")
    if path and not cfg.initial_load_in_hf and not files.is_complete(Path(path)):
        raise ConfigError(f"config error: checkpoint.initial_load_path: {path} is not a DCP checkpoint folder "
                          "(no .metadata); point it at a step-N folder, or set initial_load_in_hf for HF weights")
