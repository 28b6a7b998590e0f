"""One-process helpers for the offline scripts (scripts/convert_checkpoint.py, generate.py):
a DCP step folder's weights as whole tensors, and which model (spec, args) has a given
set of weight shapes, including multi-token-prediction modules and runs that started
from an HF folder (`--model.hf_path`, which have no flavor). In-run import and export
live in trainer/hf_io.py; these hold the whole model in one process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from models.hf_config import HFConfigError
from trainer.hf_io import args_from_hf_folder, with_mtp_depth


def dcp_model_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Native key -> shape of the model weights in a DCP checkpoint folder (step-N)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise HFConfigError(f"hf error: {path} is not a DCP checkpoint folder (no .metadata)")
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k.removeprefix("model."): tuple(v.size) for k, v in meta.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


def load_dcp_model_state_dict(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model weights of a DCP checkpoint (full or model-only) as whole tensors, in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    dcp_model_shapes(path)  # raises on a non-DCP folder
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    sd = {k.removeprefix("model."): torch.empty(tuple(v.size), dtype=v.properties.dtype)
          for k, v in meta.items() if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    dcp.load({"model": sd}, checkpoint_id=str(path), no_dist=True)
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    return sd


def mtp_depth_of(shapes: dict[str, tuple[int, ...]]) -> int:
    """Multi-token-prediction modules (`mtp.{k}.*` keys) in a native state dict."""
    return len({k.split(".")[1] for k in shapes if k.startswith("mtp.")})


def infer_model_from_shapes(shapes: dict[str, tuple[int, ...]], model: str | None = None,
                            flavor: str | None = None, hf_path: str | Path | None = None):
    """(spec, flavor name or None, args) whose model has exactly these weight shapes (MTP
    modules included); with `model` / `flavor` given, checks them instead; with `hf_path`,
    the args come from that folder's config.json (a run started from it has no flavor).
    Raises one line when none or several fit."""
    from models import MODEL_SPECS, get_model_spec

    depth = mtp_depth_of(shapes)
    if hf_path is not None:
        spec, args = args_from_hf_folder(hf_path)
        args = with_mtp_depth(args, depth)
        if spec.state_dict_adapter.for_args(args).native_shapes() != shapes:
            raise HFConfigError(f"hf error: the checkpoint's weight shapes are not those of the {spec.name} model in "
                                f"{hf_path}/config.json; pass the HF folder the run started from")
        return spec, None, args
    specs = [get_model_spec(model)] if model else [s for s in MODEL_SPECS.values() if s.state_dict_adapter]
    fits = []
    for spec in specs:
        for name, args in spec.flavors.items():
            if flavor and name != flavor:
                continue
            args = with_mtp_depth(args, depth)
            if spec.state_dict_adapter.for_args(args).native_shapes() == shapes:
                fits.append((spec, name, args))
    if len(fits) == 1:
        return fits[0]
    if not fits:
        wanted = f"{model or '?'} / {flavor or '?'}"
        raise HFConfigError(f"hf error: no model flavor ({wanted}) has the checkpoint's {len(shapes)} weight "
                            "shapes; pass --model and --flavor of the run that wrote it, or --model.hf_path of the HF "
                            "folder it started from")
    raise HFConfigError(f"hf error: several flavors fit the checkpoint's shapes "
                        f"({[f'{s.name}/{n}' for s, n, _ in fits]}); pass --model and --flavor")


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                      "tokenizer.model")


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copies an HF folder's tokenizer files (and generation_config.json) into an export,
    so that the export is a complete model folder; returns the names copied."""
    copied = []
    for name in HF_TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
