"""Hugging Face safetensors folders: import into a (sharded) model, export from one.

Import (`load_hf_into_model`): each native tensor is built by its model's adapter
recipe (models/hf_config.py). For a DTensor parameter under FSDP / TP / EP the
rank computes which rectangle of the global tensor it holds (FSDP-over-TP
`_StridedShard` included) and reads only the bytes of that rectangle from the
safetensors files (memory-mapped slices), then copies it into its local shard in
place. A local block that is not a rectangle falls back to building the full tensor
and `distribute_tensor(..., src_data_rank=None)` on the parameter's mesh and
placements, which slices locally without communication. We do not use DCP's HuggingFaceStorageReader:
our recipes (interleaved-RoPE row permutations, per-expert HF tensors stacked into
grouped [E, in, out] tensors) are not 1:1 renames, and applying them region by
region gives the same "read only your shard" property without HF-shaped DTensors.
FP8 block-quantized weights (DeepSeek V3 on the Hub) are dequantized by `HFReader`,
region by region too. `load_hf_weights` is the trainer's entry for `--model.hf_path`.

Export (`save_hf`): parameters are gathered one at a time (`full_tensor()`, a
collective on the parameter's mesh), converted by the recipes, cast to the export
dtype and written by one rank per distinct set of keys (one per pipeline stage)
into safetensors shards of bounded size; rank 0 then names the shards
model-0000k-of-0000N.safetensors (or model.safetensors), writes the index and
config.json. Before any collective every rank checks that the format can hold what
it has (DeepSeek V2: no routing bias) and all agree, so a refusal cannot hang the
others. The result loads with transformers' AutoModelForCausalLM.

One-process helpers for the offline scripts (DCP folders, models from shapes) are in
trainer/offline_convert.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from models.hf_config import (FP8_DTYPES, HFConfigError, HFStateDictAdapter, Region,  # noqa: F401
                              dequantize_fp8_block, fp8_block_size, full_region, matching_flavors,
                              model_from_hf_folder, read_hf_config, region_shape, spec_for_hf_config)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- specs


def spec_for_model(model: torch.nn.Module):
    """The ModelSpec whose model class `model` is (FSDP-wrapped classes included)."""
    from models import MODEL_SPECS

    for spec in MODEL_SPECS.values():
        if isinstance(spec.model_cls, type) and isinstance(model, spec.model_cls):
            if spec.state_dict_adapter is None:
                raise HFConfigError(f"hf error: model {spec.name} has no Hugging Face state-dict adapter")
            return spec
    raise HFConfigError(f"hf error: no model spec for {type(model).__name__}")


def args_from_hf_folder(folder: str | Path):
    """(spec, model args) described by an HF folder's config.json."""
    from models import MODEL_SPECS

    name, args = model_from_hf_folder(folder)
    return MODEL_SPECS[name], args


# --------------------------------------------------------------------------- reading


class HFReader:
    """Lazy reader of a safetensors folder: single file or sharded with an index.

    FP8 block-quantized weights (DeepSeek V3 on the Hub: `weight` in float8_e4m3fn next to
    `weight_scale_inv`, one fp32 scale per block) come out dequantized to fp32, region by
    region: a rank reads only its slice of the FP8 tensor and the few scales covering it."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self._safe_open = safe_open
        self.folder = Path(folder)
        self.fp8_block = None
        if (self.folder / "config.json").is_file():
            self.fp8_block = fp8_block_size(read_hf_config(self.folder), f"{self.folder / 'config.json'}")
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.folder / SINGLE_FILE).is_file():
            with safe_open(str(self.folder / SINGLE_FILE), framework="pt") as f:
                weight_map = {k: SINGLE_FILE for k in f.keys()}
        else:
            raise HFConfigError(f"hf error: {self.folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.weight_map: dict[str, str] = dict(weight_map)
        self._handles: dict[str, Any] = {}

    def _handle(self, key: str):
        fname = self.weight_map[key]
        if fname not in self._handles:
            path = self.folder / fname
            if not path.is_file():
                raise HFConfigError(f"hf error: {path} (listed in {INDEX_FILE} for {key}) does not exist")
            self._handles[fname] = self._safe_open(str(path), framework="pt")
        return self._handles[fname]

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(self._handle(k).get_slice(k).get_shape()) for k in self.weight_map}

    def get(self, key: str, region: Region) -> torch.Tensor:
        """The block `region` of tensor `key`, reading only those bytes (dequantized if FP8)."""
        block = self._handle(key).get_slice(key)[tuple(region)]
        scale_key = key + "_scale_inv"
        if block.dtype in FP8_DTYPES and scale_key in self.weight_map:
            if self.fp8_block is None or len(region) != 2:
                raise HFConfigError(f"hf error: {self.folder}: {key} is FP8 with block scales, but config.json "
                                    "has no quantization_config with a 2-D weight_block_size")
            (rows, cols), (br, bc) = region, self.fp8_block
            scales = self._handle(scale_key).get_slice(scale_key)[
                rows.start // br: (rows.stop - 1) // br + 1, cols.start // bc: (cols.stop - 1) // bc + 1]
            block = dequantize_fp8_block(block, scales, region, self.fp8_block)
        elif block.dtype in FP8_DTYPES:
            raise HFConfigError(f"hf error: {self.folder}: {key} is {block.dtype} without {scale_key}; only FP8 "
                                "block-quantized weights (with their scales) can be read")
        return block

    def full(self, key: str) -> torch.Tensor:
        return self.get(key, full_region(self._handle(key).get_slice(key).get_shape()))

    def close(self) -> None:
        for h in self._handles.values():
            exit_ = getattr(h, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._handles.clear()


def _local_region(t: DTensor) -> Region | None:
    """The rectangle of the global tensor this rank holds; None when this rank is not in
    the mesh or the local block is not a rectangle (callers then distribute the whole).

    Uses DTensor's own (private) shape/offset helper, the one DCP relies on, which also
    knows FSDP-over-TP `_StridedShard`; without it, only Shard/Replicate placements are
    handled (ceil-sized chunks, applied mesh dim by mesh dim)."""
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return None
    local_shape = tuple(t.to_local().shape)
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if tuple(shape) == local_shape:
            return tuple(slice(int(o), int(o) + int(n)) for o, n in zip(offset, shape))
        return None
    except (ImportError, TypeError, ValueError):
        pass
    if not all(type(p) in (Shard, Replicate) for p in t.placements):
        return None
    starts, sizes = [0] * t.ndim, list(t.shape)
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, Shard):
            d, n, c = p.dim % t.ndim, t.device_mesh.size(mesh_dim), coord[mesh_dim]
            chunk = math.ceil(sizes[d] / n) if sizes[d] else 0
            off = min(c * chunk, sizes[d])
            starts[d] += off
            sizes[d] = max(0, min(chunk, sizes[d] - off))
    if tuple(sizes) != local_shape:
        return None
    return tuple(slice(s, s + n) for s, n in zip(starts, sizes))


def _materialize(recipe, value: torch.Tensor, get, force_full: bool = False) -> torch.Tensor:
    """`value`'s tensor from the HF recipe, as a plain tensor or a DTensor laid out like
    `value` (force_full: always take the build-whole-then-distribute path; for tests)."""
    if isinstance(value, DTensor):
        local = value.to_local()
        region = None if force_full else _local_region(value)
        if region is not None:
            if any(n == 0 for n in region_shape(region)):
                block = torch.empty(region_shape(region), dtype=value.dtype)
            else:
                block = recipe.load(get, region)
            block = block.to(dtype=value.dtype, device=local.device).contiguous()
            return DTensor.from_local(block, value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())
        full = recipe.load(get, full_region(value.shape)).to(dtype=value.dtype, device=local.device)
        return distribute_tensor(full.contiguous(), value.device_mesh, value.placements, src_data_rank=None)
    return recipe.load(get, full_region(value.shape)).to(dtype=value.dtype, device=value.device).contiguous()


@torch.no_grad()
def _load_into(recipe, value: torch.Tensor, get) -> None:
    """Fills `value` (a state-dict tensor sharing storage with the parameter or buffer) in
    place from the HF recipe: only the local block is read, on the CPU, then copied (with
    any dtype cast) into the local shard, so no second copy of the model is ever held."""
    if isinstance(value, DTensor):
        region = _local_region(value)
        if region is None:
            block = _materialize(recipe, value, get, force_full=True).to_local()
        elif any(n == 0 for n in region_shape(region)):
            return
        else:
            block = recipe.load(get, region)
        value.to_local().copy_(block)
    else:
        value.copy_(recipe.load(get, full_region(value.shape)))


def check_hf_matches(spec, args, hf_cfg: dict[str, Any], folder: str | Path) -> None:
    """Raises one line when the folder's config.json describes another model than `args`."""
    adapter_cls = spec.state_dict_adapter
    if hf_cfg.get("model_type") not in (None, *adapter_cls.reads_model_types()):
        raise HFConfigError(f"hf error: {folder}/config.json is a {hf_cfg.get('model_type')!r} model, not "
                            f"{adapter_cls.model_type!r} ({spec.name}); pass --model.hf_path {folder} alone to "
                            "build the model it holds")
    hf_args = adapter_cls.args_from_hf(hf_cfg)
    diff = adapter_cls(args).mismatches(hf_args)
    if diff:
        flavors = matching_flavors(spec, hf_args)
        hint = f"use --model.flavor {flavors[0]}" if flavors else "add a flavor with these args"
        raise HFConfigError(f"hf error: {folder}/config.json does not match the {spec.name} model being built "
                            f"(checkpoint vs model: {'; '.join(diff)}); {hint}")


def load_hf_into_model(model_parts: list[torch.nn.Module], folder: str | Path) -> None:
    """Loads an HF safetensors folder into model parts (any parallel layout, pipeline
    stages included); every rank reads only the slices of the tensors it holds.
    Missing / unexpected keys and shape mismatches raise one HFConfigError."""
    folder = Path(folder)
    spec = spec_for_model(model_parts[0])
    args = model_parts[0].args
    hf_cfg = read_hf_config(folder)
    check_hf_matches(spec, args, hf_cfg, folder)
    adapter: HFStateDictAdapter = spec.state_dict_adapter.for_args(args, hf_cfg)
    reader = HFReader(folder)
    try:
        adapter.check_hf_keys(reader.shapes(), str(folder))
        recipes = adapter.recipes()
        for part in model_parts:
            # Values share storage with the module's parameters / buffers (FSDP2 returns its
            # sharded DTensor parameters), so filling them in place loads the model.
            for k, v in get_model_state_dict(part).items():
                _load_into(recipes[k], v, reader.get)
    finally:
        reader.close()


def load_hf_weights(model_parts: list[torch.nn.Module], folder: str | Path) -> None:
    """`load_hf_into_model` for `--model.hf_path`: a bad folder is one ConfigError line."""
    from configuration.fields import ConfigError

    try:
        load_hf_into_model(model_parts, folder)
    except HFConfigError as e:
        raise ConfigError("config error: model.hf_path: " + str(e).removeprefix("hf error: ")) from None


def with_mtp_depth(args, depth: int):
    """`args` with `depth` MTP modules (unchanged for a model without multi-token prediction)."""
    import dataclasses

    if depth and "mtp_depth" in {f.name for f in dataclasses.fields(args)}:
        return dataclasses.replace(args, mtp_depth=depth)
    return args


def load_hf_state_dict(folder: str | Path, mtp_depth: int = 0) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """(spec, args, native state dict of whole tensors) of an HF folder (one process), with
    its first `mtp_depth` multi-token-prediction layers."""
    folder = Path(folder)
    hf_cfg = read_hf_config(folder)
    spec = spec_for_hf_config(hf_cfg)
    args = with_mtp_depth(spec.state_dict_adapter.args_from_hf(hf_cfg), mtp_depth)
    stored = spec.state_dict_adapter.hf_mtp_layers(hf_cfg)
    if mtp_depth > stored:
        raise HFConfigError(f"hf error: {folder} holds {stored} multi-token-prediction layer(s), not {mtp_depth}")
    adapter = spec.state_dict_adapter.for_args(args, hf_cfg)
    reader = HFReader(folder)
    try:
        adapter.check_hf_keys(reader.shapes(), str(folder))
        shapes = adapter.native_shapes()
        sd = {k: r.load(reader.get, full_region(shapes[k])).clone() for k, r in adapter.recipes().items()}
    finally:
        reader.close()
    return spec, args, sd


# --------------------------------------------------------------------------- writing


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather_object(obj):
    rank, world = _rank_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _write_hf(items: Iterable[tuple[str, torch.Tensor]], adapter: HFStateDictAdapter, folder: Path,
              dtype: torch.dtype, writer: bool, max_shard_bytes: int, config: dict[str, Any]) -> None:
    """Converts (native key, whole tensor) items and writes them (on writer ranks) as
    safetensors shards; then rank 0 names the shards and writes index + config."""
    from safetensors.torch import save_file

    rank, _ = _rank_world()
    recipes = adapter.recipes()
    fp32_keys = getattr(adapter, "fp32_hf_suffixes", ())
    written: list[tuple[str, dict[str, int]]] = []
    buf: dict[str, torch.Tensor] = {}
    buf_bytes = 0

    def flush():
        nonlocal buf, buf_bytes
        if buf:
            name = f"tmp-r{rank:05d}-{len(written):05d}.safetensors"
            save_file(buf, str(folder / name), metadata={"format": "pt"})
            written.append((name, {k: v.numel() * v.element_size() for k, v in buf.items()}))
        buf, buf_bytes = {}, 0

    for key, tensor in items:
        if not writer:
            continue
        if key not in recipes:
            raise HFConfigError(f"hf error: no HF name for native key {key!r}")
        for hk, ht in recipes[key].to_hf(tensor.detach()).items():
            target = torch.float32 if hk.endswith(tuple(fp32_keys)) else dtype
            ht = ht.to(device="cpu", dtype=target if ht.is_floating_point() else ht.dtype).contiguous().clone()
            buf[hk] = ht
            buf_bytes += ht.numel() * ht.element_size()
            if buf_bytes >= max_shard_bytes:
                flush()
    flush()

    gathered = _all_gather_object((rank, written))
    if rank == 0:
        shards = [(r, name, sizes) for r, files in sorted(gathered) for name, sizes in files]
        n = len(shards)
        weight_map: dict[str, str] = {}
        total = 0
        for i, (_, name, sizes) in enumerate(shards):
            final = SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(folder / name, folder / final)
            for k, nbytes in sizes.items():
                if k in weight_map:
                    raise HFConfigError(f"hf error: export wrote {k} twice")
                weight_map[k] = final
                total += nbytes
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _barrier()


def _prepare_folder(folder: Path) -> None:
    rank, _ = _rank_world()
    if rank == 0:
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
    _barrier()


def save_hf(model_parts: list[torch.nn.Module], folder: str | Path, *, dtype: torch.dtype = torch.float32,
            max_shard_bytes: int = 4 << 30) -> None:
    """Exports model parts (any layout; call on every rank) as an HF folder."""
    folder = Path(folder)
    spec = spec_for_model(model_parts[0])
    adapter = spec.state_dict_adapter.for_args(model_parts[0].args)
    rank, _ = _rank_world()
    keys = sorted(k for part in model_parts for k in get_model_state_dict(part))
    # Every rank checks what it holds unsharded (e.g. routing biases) and all agree, so that
    # a refusal stops every rank before any collective of the export.
    local = {k: v for part in model_parts for k, v in get_model_state_dict(part).items() if not isinstance(v, DTensor)}
    problems = [p for p in _all_gather_object(adapter.check_exportable(local)) if p]
    if problems:
        raise HFConfigError(problems[0])
    config = adapter.hf_config(dtype)  # raises, on every rank alike, for a model this format cannot hold
    owners = _all_gather_object((rank, keys))
    writer = rank == min(r for r, ks in owners if ks == keys)
    _prepare_folder(folder)

    def items() -> Iterator[tuple[str, torch.Tensor]]:
        for part in model_parts:
            for k, v in get_model_state_dict(part).items():
                yield k, (v.full_tensor() if isinstance(v, DTensor) else v)

    _write_hf(items(), adapter, folder, dtype, writer, max_shard_bytes, config)


def save_hf_state_dict(sd: dict[str, torch.Tensor], spec, args, folder: str | Path, *,
                       dtype: torch.dtype = torch.float32, max_shard_bytes: int = 4 << 30) -> None:
    """Writes a native state dict of whole tensors as an HF folder (one process)."""
    folder = Path(folder)
    adapter = spec.state_dict_adapter.for_args(args)
    missing = sorted(set(adapter.native_shapes()) - set(sd))
    if missing:
        raise HFConfigError(f"hf error: the state dict lacks {len(missing)} key(s) of {spec.name}: {missing[:8]}")
    problem = adapter.check_exportable(sd)
    if problem:
        raise HFConfigError(problem)
    config = adapter.hf_config(dtype)
    _prepare_folder(folder)
    _write_hf(sd.items(), adapter, folder, dtype, True, max_shard_bytes, config)
