"""Fetches a tokenizer from the Hugging Face Hub: a Llama 3 tokenizer.model (tiktoken format),
or with `--filename tokenizer.json` an HF tokenizer.json (DeepSeek's).

    python scripts/download_tokenizer.py --repo_id meta-llama/Llama-3.1-8B --hf_token hf_...
    # -> assets/tokenizer/Llama-3.1-8B/tokenizer.model; then train with
    #    --model.tokenizer_path assets/tokenizer/Llama-3.1-8B/tokenizer.model
    python scripts/download_tokenizer.py --repo_id meta-llama/Llama-3.1-8B --local_dir assets/tokenizer/llama3
    # -> where train_configs/llama*.toml look (the trainer's error names each shipped config's command)

Meta's repos are gated: accept the licence on the model page first and pass a
token with read access (or set HF_TOKEN). Uses `huggingface_hub` when it is
installed, else plain urllib. Needs network access; on an offline machine it
stops with a message saying so, and you can copy the file in by hand instead.
The file is checked after download (it must parse, and Llama 3 has 128000 ranks).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

HUB = "https://huggingface.co"


def _have_hf_hub() -> bool:
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        return False
    return True


def _fetch_with_hf_hub(repo_id: str, filename: str, token: str | None, revision: str, dest: str) -> None:
    from huggingface_hub import hf_hub_download

    with tempfile.TemporaryDirectory(dir=os.path.dirname(dest)) as tmp:
        try:
            got = hf_hub_download(repo_id=repo_id, filename=filename, revision=revision, token=token, local_dir=tmp)
        except Exception as e:  # offline, gated, missing file: one clear line
            raise SystemExit(f"error: could not download {filename} from {HUB}/{repo_id} "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                             "check network access, the repo id, and that --hf_token has accepted the licence") from None
        os.replace(got, dest)


def _fetch_with_urllib(repo_id: str, filename: str, token: str | None, revision: str, dest: str) -> None:
    url = f"{HUB}/{repo_id}/resolve/{urllib.parse.quote(revision, safe='')}/{urllib.parse.quote(filename)}"
    req = urllib.request.Request(url, headers={"User-Agent": "titanlite-download-tokenizer"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer.", suffix=".part", dir=os.path.dirname(dest))
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    shutil.copyfileobj(resp, out)
            except urllib.error.HTTPError as e:
                hint = {401: "the token is missing or invalid (pass --hf_token or set HF_TOKEN)",
                        403: "access denied: accept the model's licence on its Hub page with this account",
                        404: f"no file {filename!r} in {repo_id} (check --repo_id / --filename)"}.get(e.code, e.reason)
                raise SystemExit(f"error: {url} returned HTTP {e.code}: {hint}") from None
            except (urllib.error.URLError, TimeoutError, OSError) as e:
                reason = getattr(e, "reason", e)
                raise SystemExit(f"error: could not reach huggingface.co ({reason}); this machine seems offline. "
                                 f"Download {url} elsewhere and copy it to {dest}") from None
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo_id", required=True, help="Hub repo, e.g. meta-llama/Llama-3.1-8B")
    ap.add_argument("--hf_token", default=os.environ.get("HF_TOKEN"), help="Hub token (default: $HF_TOKEN)")
    ap.add_argument("--filename", default="original/tokenizer.model", help="path of the file inside the repo")
    ap.add_argument("--revision", default="main")
    ap.add_argument("--local_dir", default=None,
                    help="output folder (default: assets/tokenizer/<repo name>); the file is saved as tokenizer.json "
                         "when --filename ends in .json, else as tokenizer.model")
    args = ap.parse_args(argv)

    local_dir = args.local_dir or os.path.join(REPO_ROOT, "assets", "tokenizer", args.repo_id.rstrip("/").split("/")[-1])
    os.makedirs(local_dir, exist_ok=True)
    dest = os.path.join(local_dir, "tokenizer.json" if args.filename.endswith(".json") else "tokenizer.model")
    fetch = _fetch_with_hf_hub if _have_hf_hub() else _fetch_with_urllib
    fetch(args.repo_id, args.filename, args.hf_token, args.revision, dest)
    if dest.endswith(".json"):  # its BOS/EOS tokens are named in tokenizer_config.json beside it
        beside = "/".join([*args.filename.split("/")[:-1], "tokenizer_config.json"])
        fetch(args.repo_id, beside, args.hf_token, args.revision, os.path.join(local_dir, "tokenizer_config.json"))

    from configuration.fields import ConfigError
    from trainer.data.tokenizer import build_tokenizer

    try:
        tok = build_tokenizer(dest)
    except ConfigError as e:
        os.unlink(dest)
        kind = "an HF tokenizer.json" if dest.endswith(".json") else "a tiktoken BPE file"
        raise SystemExit(f"error: downloaded file is not {kind} ({e}); is --filename right?") from None
    base = getattr(tok, "num_base_tokens", None)
    if base is None:  # tokenizer.json
        print(f"saved {dest}: vocab_size {tok.vocab_size}")
    else:
        note = "" if base == 128000 else " (not 128000 ranks: not a Llama 3 tokenizer, small special set used)"
        print(f"saved {dest}: {base} ranks, vocab_size {tok.vocab_size}{note}")
    print(f"use it with --model.tokenizer_path {dest}")
    return dest


if __name__ == "__main__":
    main()
