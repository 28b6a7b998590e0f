"""Distributed checkpoints (torch.distributed.checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.configurable import opt


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
