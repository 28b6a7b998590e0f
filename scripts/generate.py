"""Samples text from a DCP or Hugging Face checkpoint.

    python scripts/generate.py --model.hf_path /data/Llama-3.1-8B --prompt "Hello" --temperature 0   # greedy
    python scripts/generate.py --checkpoint outputs/checkpoint/step-1000 --prompt "def main(" \
        [--model llama3 --flavor debug | --model.hf_path DIR] [--max_new_tokens 64] [--temperature 0.8] [--top_k 50]

`--model.hf_path DIR` (as in training) takes everything from an HF folder: the model
shape (config.json), the weights (unless --checkpoint gives others) and the tokenizer.
`--checkpoint` is an HF folder (config.json) or a DCP step folder (.metadata): the
model of a DCP checkpoint is `--model.hf_path`'s for a run that started from one, else
`--model/--flavor`, else inferred from the weight shapes (multi-token-prediction
modules are recognised and not used for sampling). The prompt is encoded with
`--tokenizer` (default: the HF folder's own, else the repo's debug tokenizer) after
BOS, and sampling stops at EOS (or another of generation_config.json's end tokens).
No KV cache: every new token re-runs the (short) context, which is plenty for
checking a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from models.hf_config import HFConfigError  # noqa: E402


def load_model(checkpoint: str | None, model: str | None = None, flavor: str | None = None,
               device: str = "cpu", hf_path: str | None = None) -> torch.nn.Module:
    """Our model with the weights of an HF folder or a DCP step folder, in eval mode."""
    from parallelisms.apply import build_model
    from trainer.hf_io import args_from_hf_folder, load_hf_into_model
    from trainer.offline_convert import dcp_model_shapes, infer_model_from_shapes, load_dcp_model_state_dict

    path = Path(checkpoint or hf_path)
    if (path / "config.json").is_file():
        spec, args = args_from_hf_folder(hf_path or path)
        net = build_model(spec, args, "cpu")
        net.init_weights()
        load_hf_into_model([net], path)
    elif (path / ".metadata").is_file():
        spec, _, args = infer_model_from_shapes(dcp_model_shapes(path), model, flavor, hf_path)
        net = build_model(spec, args, "cpu")
        net.init_weights()
        net.load_state_dict(load_dcp_model_state_dict(path), strict=True)
    else:
        raise HFConfigError(f"hf error: {path} is neither an HF folder (config.json) nor a DCP step folder "
                            "(.metadata)")
    return net.to(device).eval()


def default_tokenizer(checkpoint: str | None, hf_path: str | None) -> str:
    """The HF folder's own tokenizer when there is one, else the repo's debug tokenizer."""
    from trainer.config import DEFAULT_TOKENIZER
    from trainer.data.tokenizer import resolve_tokenizer_file

    for folder in (checkpoint, hf_path):
        if folder and (Path(folder) / "config.json").is_file() and resolve_tokenizer_file(folder):
            return folder
    return DEFAULT_TOKENIZER


def tokenizer_hint(checkpoint: str | None, hf_path: str | None) -> str:
    """Which --tokenizer fits the model, for the vocab-size error."""
    from trainer.config import DEFAULT_TOKENIZER

    folder = default_tokenizer(checkpoint, hf_path)
    if folder != DEFAULT_TOKENIZER:
        return f"pass --tokenizer {folder} (the model's own)"
    return ("pass --tokenizer with the tokenizer the model was trained with (the run's model.tokenizer_path, or "
            "the HF folder it started from)")


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, eos_id: int | None = None, generator: torch.Generator | None = None,
             max_context: int | None = None, stop_ids=()) -> list[int]:
    """New token ids after `prompt`. temperature 0 = greedy; top_k keeps the k most likely;
    stops after `eos_id` or any of `stop_ids`."""
    stops = set(stop_ids) | ({eos_id} if eos_id is not None else set())
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        ctx = ids if max_context is None else ids[:, -max_context:]
        logits = model(ctx)[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        out.append(nxt)
        if nxt in stops:
            break
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="HF folder or DCP step folder (default: --model.hf_path)")
    p.add_argument("--model.hf_path", "--hf_path", dest="hf_path", default=None,
                   help="HF model folder: shape, weights (unless --checkpoint) and tokenizer")
    p.add_argument("--model", default=None, help="model spec name for a DCP checkpoint (default: inferred)")
    p.add_argument("--flavor", default=None, help="flavor for a DCP checkpoint (default: inferred)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, tiktoken file or folder (default: the HF "
                   "folder's own, else the repo's debug tokenizer)")
    p.add_argument("--prompt", default="")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no_bos", action="store_true", help="do not start the prompt with BOS")
    ns = p.parse_args(argv)
    if not ns.checkpoint and not ns.hf_path:
        p.error("pass --checkpoint or --model.hf_path")

    from configuration.fields import ConfigError
    from trainer.data.tokenizer import build_tokenizer

    try:
        tok = build_tokenizer(ns.tokenizer or default_tokenizer(ns.checkpoint, ns.hf_path), field="--tokenizer")
        model = load_model(ns.checkpoint, ns.model, ns.flavor, ns.device, hf_path=ns.hf_path)
    except (ConfigError, HFConfigError, KeyError) as e:
        print(str(e).strip("'\""), file=sys.stderr)
        return 2
    vocab = model.args.vocab_size
    if tok.vocab_size > vocab:
        print(f"error: the tokenizer {tok.path} has {tok.vocab_size} tokens but the model only {vocab}; "
              f"{tokenizer_hint(ns.checkpoint, ns.hf_path)}", file=sys.stderr)
        return 2
    prompt = tok.encode(ns.prompt, bos=not ns.no_bos)
    if not prompt:
        print("empty prompt: drop --no_bos or give --prompt", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(ns.seed)
    for i in range(ns.num_samples):
        new = generate(model, prompt, ns.max_new_tokens, temperature=ns.temperature, top_k=ns.top_k,
                       stop_ids=tok.stop_ids, generator=gen, max_context=getattr(model.args, "max_seq_len", None))
        text = tok.decode(new)
        print(f"--- sample {i} ({len(new)} tokens) ---\n{ns.prompt}{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
