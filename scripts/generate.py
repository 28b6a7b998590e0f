"""Samples text from a DCP or Hugging Face checkpoint.

    python scripts/generate.py --checkpoint outputs/checkpoint/step-1000 --prompt "def main(" \
        [--model llama3 --flavor debug] [--max_new_tokens 64] [--temperature 0.8] [--top_k 50] [--seed 0]
    python scripts/generate.py --checkpoint path/to/hf_folder --prompt "Hello" --temperature 0   # greedy

The checkpoint kind is detected: a folder with config.json is a Hugging Face folder
(model args from config.json); a folder with .metadata is a DCP step folder (model
and flavor from --model/--flavor, or inferred from the weight shapes). The prompt
is encoded with --tokenizer (trainer.data.tokenizer.build_tokenizer) after a BOS
token. No KV cache: every new token re-runs the (short) context, which is plenty
for checking a checkpoint.
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


def load_model(checkpoint: str, model: str | None = None, flavor: str | None = None,
               device: str = "cpu") -> torch.nn.Module:
    """Our model with the weights of an HF folder or a DCP step folder, in eval mode."""
    from trainer.hf_io import args_from_hf_folder, dcp_model_shapes, infer_model_from_shapes, \
        load_dcp_model_state_dict, load_hf_into_model

    path = Path(checkpoint)
    if (path / "config.json").is_file():
        spec, args = args_from_hf_folder(path)
        net = spec.model_cls(args)
        net.init_weights()
        load_hf_into_model([net], path)
    elif (path / ".metadata").is_file():
        spec, flavor = infer_model_from_shapes(dcp_model_shapes(path), model, flavor)
        net = spec.model_cls(spec.flavors[flavor])
        net.init_weights()
        sd = load_dcp_model_state_dict(path)
        net.load_state_dict(sd, strict=True)
    else:
        raise HFConfigError(f"hf error: {path} is neither an HF folder (config.json) nor a DCP step folder "
                            "(.metadata)")
    return net.to(device).eval()


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, eos_id: int | None = None, generator: torch.Generator | None = None,
             max_context: int | None = None) -> list[int]:
    """New token ids after `prompt`. temperature 0 = greedy; top_k keeps the k most likely."""
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
        if eos_id is not None and nxt == eos_id:
            break
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    return out


def main(argv: list[str] | None = None) -> int:
    from trainer.config import DEFAULT_TOKENIZER

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="HF folder or DCP step folder")
    p.add_argument("--model", default=None, help="model spec name for a DCP checkpoint (default: inferred)")
    p.add_argument("--flavor", default=None, help="flavor for a DCP checkpoint (default: inferred)")
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="tiktoken-format tokenizer file")
    p.add_argument("--prompt", default="")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no_bos", action="store_true", help="do not start the prompt with BOS")
    ns = p.parse_args(argv)

    from trainer.configurable import ConfigError
    from trainer.data.tokenizer import build_tokenizer

    try:
        tok = build_tokenizer(ns.tokenizer)
        model = load_model(ns.checkpoint, ns.model, ns.flavor, ns.device)
    except (ConfigError, HFConfigError, KeyError) as e:
        print(str(e).strip("'\""), file=sys.stderr)
        return 2
    vocab = model.args.vocab_size
    if tok.vocab_size > vocab:
        print(f"the tokenizer has {tok.vocab_size} tokens but the model only {vocab}", file=sys.stderr)
        return 2
    prompt = tok.encode(ns.prompt, bos=not ns.no_bos)
    if not prompt:
        print("empty prompt: drop --no_bos or give --prompt", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(ns.seed)
    for i in range(ns.num_samples):
        new = generate(model, prompt, ns.max_new_tokens, temperature=ns.temperature, top_k=ns.top_k,
                       eos_id=tok.eos_id, generator=gen, max_context=getattr(model.args, "max_seq_len", None))
        text = tok.decode(new)
        print(f"--- sample {i} ({len(new)} tokens) ---\n{ns.prompt}{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
