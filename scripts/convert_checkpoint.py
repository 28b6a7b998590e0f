"""Converts model weights between our DCP checkpoints and Hugging Face folders.

    # DCP step folder (full training state or model-only) -> HF folder (config.json + safetensors)
    python scripts/convert_checkpoint.py dcp-to-hf outputs/checkpoint/step-1000 hf_out \
        [--model llama3 --flavor 8B | --model.hf_path /data/Llama-3.1-8B] [--dtype bfloat16] [--max_shard_gb 4]

    # HF folder (single or sharded safetensors, FP8 block-quantized included) -> model-only DCP
    # folder, usable as --checkpoint.initial_load_path
    python scripts/convert_checkpoint.py hf-to-dcp path/to/Llama-3.1-8B dcp_out/step-0

dcp-to-hf picks the model: `--model.hf_path` (the HF folder a run started from with
model.hf_path: its config.json gives the shape, and its tokenizer files are copied
into the output, so that the export is a complete model folder), else
--model/--flavor, else the one flavor whose weight shapes match the checkpoint. MTP
modules in the checkpoint are recognised and exported in the hub layout. Both
directions run in one process on CPU and hold the whole model in memory; for a
sharded model inside a run use checkpoint.last_save_in_hf instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from models.hf_config import HFConfigError  # noqa: E402
from trainer.hf_io import DTYPES, load_hf_state_dict, matching_flavors, save_hf_state_dict  # noqa: E402
from trainer.offline_convert import (  # noqa: E402
    copy_tokenizer_files,
    dcp_model_shapes,
    infer_model_from_shapes,
    load_dcp_model_state_dict,
)


def dcp_to_hf(src: str, dst: str, *, model: str | None, flavor: str | None, dtype: str, max_shard_gb: float,
              hf_path: str | None = None) -> None:
    spec, flavor, args = infer_model_from_shapes(dcp_model_shapes(src), model, flavor, hf_path)
    sd = load_dcp_model_state_dict(src)
    save_hf_state_dict(sd, spec, args, dst, dtype=DTYPES[dtype], max_shard_bytes=int(max_shard_gb * (1 << 30)))
    copied = copy_tokenizer_files(hf_path, dst) if hf_path else []
    what = f"{spec.name} {flavor}" if flavor else f"{spec.name} from {hf_path}"
    print(f"wrote {dst}: {what}, {len(sd)} tensors, {dtype}" + (f"; copied {', '.join(copied)}" if copied else ""))


def hf_to_dcp(src: str, dst: str, *, dtype: str, mtp_depth: int = 0) -> None:
    import torch.distributed.checkpoint as dcp

    spec, args, sd = load_hf_state_dict(src, mtp_depth)
    sd = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in sd.items()}
    # The routing bias is fp32 in the model whatever the weights' dtype.
    sd = {k: v.float() if k.endswith("expert_bias") else v for k, v in sd.items()}
    os.makedirs(dst, exist_ok=True)
    dcp.save({"model": sd}, checkpoint_id=dst, no_dist=True)
    flavors = matching_flavors(spec, args)
    model = f"--model.name {spec.name} --model.flavor {flavors[0]}" if flavors else f"--model.hf_path {src}"
    model += f" --model.mtp_depth {mtp_depth}" if mtp_depth else ""
    print(f"wrote {dst}: {spec.name}, {len(sd)} tensors; train from it with {model} --checkpoint.enable true "
          f"--checkpoint.initial_load_path {dst}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("dcp-to-hf", help="DCP step folder -> HF folder")
    a.add_argument("input")
    a.add_argument("output")
    a.add_argument("--model", default=None, help="model spec name (default: inferred from the weight shapes)")
    a.add_argument("--flavor", default=None, help="flavor (default: inferred from the weight shapes)")
    a.add_argument("--model.hf_path", "--hf_path", dest="hf_path", default=None,
                   help="the HF folder the run started from (model.hf_path): shape and tokenizer files")
    a.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    a.add_argument("--max_shard_gb", type=float, default=4.0, help="max size of one safetensors file")
    b = sub.add_parser("hf-to-dcp", help="HF folder -> model-only DCP folder")
    b.add_argument("input")
    b.add_argument("output")
    b.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    b.add_argument("--model.mtp_depth", "--mtp_depth", dest="mtp_depth", type=int, default=0,
                   help="also convert the folder's first N multi-token-prediction layers")
    ns = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            if ns.direction == "dcp-to-hf":
                dcp_to_hf(ns.input, ns.output, model=ns.model, flavor=ns.flavor, dtype=ns.dtype,
                          max_shard_gb=ns.max_shard_gb, hf_path=ns.hf_path)
            else:
                hf_to_dcp(ns.input, ns.output, dtype=ns.dtype, mtp_depth=ns.mtp_depth)
    except (HFConfigError, KeyError) as e:
        print(str(e).strip("'\""), file=sys.stderr)
        return 2
    print(f"done in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
