"""Tokenizer: tiktoken-format loading, Llama 3 special tokens, round trips, BPE training."""

from __future__ import annotations

import base64
import importlib.util
import itertools
import os
import random
import string
from collections import Counter

import pytest

from configuration.fields import ConfigError
from trainer.data.tokenizer import Tokenizer, build_tokenizer, special_token_names, write_tiktoken_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_TOKENIZER = os.path.join(REPO, "assets", "tokenizer", "tokenizer.model")

UNICODE_TEXT = ("Héllo, wörld! Ünïcödé: 你好，世界。 Emoji 🎉🚀 and RTL שלום, maths ∑x² ≤ ∞.\n"
                "  def f(x):\n\treturn x ** 2  # it's 42's\r\n\n\n trailing   ")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer(DEBUG_TOKENIZER)


def test_debug_tokenizer_shape(tok):
    assert tok.num_base_tokens == 2032
    assert tok.vocab_size == 2048
    assert (tok.bos_id, tok.eos_id) == (2032, 2033)
    assert len(tok.special_tokens) == 16
    assert tok.special_tokens["<|eot_id|>"] == 2032 + 9
    assert tok.special_tokens["<|reserved_special_token_7|>"] == 2047


def test_round_trip_unicode(tok):
    ids = tok.encode(UNICODE_TEXT)
    assert tok.decode(ids) == UNICODE_TEXT
    assert all(0 <= i < tok.num_base_tokens for i in ids)
    assert len(ids) < len(UNICODE_TEXT.encode("utf-8"))  # merges do something


def test_bos_eos(tok):
    plain = tok.encode("hello world")
    both = tok.encode("hello world", bos=True, eos=True)
    assert both == [tok.bos_id] + plain + [tok.eos_id]
    assert tok.encode("hello world", bos=True) == [tok.bos_id] + plain
    assert tok.encode("", eos=True) == [tok.eos_id]
    assert tok.decode(both) == "<|begin_of_text|>hello world<|end_of_text|>"


def test_special_strings_in_text_are_plain_text(tok):
    text = "a <|begin_of_text|> b <|end_of_text|>"
    ids = tok.encode(text)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == text


def test_batch_encode_matches(tok):
    texts = ["one", UNICODE_TEXT, "", "three four"]
    assert tok.encode_batch(texts, bos=True, eos=True) == [tok.encode(t, bos=True, eos=True) for t in texts]


def _fake_llama3_file(path: str) -> None:
    """128000 ranks: the 256 bytes, then made-up lowercase strings of length 2, 3, 4..."""
    need = 128000 - 256
    words = (bytes(w) for n in itertools.count(2)
             for w in itertools.product(string.ascii_lowercase.encode(), repeat=n))
    ranks = {bytes([b]): b for b in range(256)}
    for i, w in enumerate(itertools.islice(words, need)):
        ranks[w] = 256 + i
    write_tiktoken_file(path, ranks)


def test_llama3_shaped_file(tmp_path):
    path = str(tmp_path / "tokenizer.model")
    _fake_llama3_file(path)
    tok = build_tokenizer(path)
    assert tok.num_base_tokens == 128000
    assert tok.vocab_size == 128256
    assert (tok.bos_id, tok.eos_id) == (128000, 128001)
    sp = tok.special_tokens
    assert sp["<|reserved_special_token_0|>"] == 128002
    assert sp["<|finetune_right_pad_id|>"] == 128004
    assert sp["<|start_header_id|>"] == 128006
    assert sp["<|end_header_id|>"] == 128007
    assert sp["<|eom_id|>"] == 128008
    assert sp["<|eot_id|>"] == 128009
    assert sp["<|python_tag|>"] == 128010
    assert sp["<|reserved_special_token_3|>"] == 128011
    assert sp["<|reserved_special_token_247|>"] == 128255
    assert sorted(sp.values()) == list(range(128000, 128256))
    text = "abc hello " + UNICODE_TEXT
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == 128000 and ids[-1] == 128001
    assert tok.decode(ids[1:-1]) == text
    assert tok.encode("aa") == [256] and tok.encode("ab") == [257]  # the first made-up tokens


def test_special_token_names_prefix():
    small, big = special_token_names(16), special_token_names(256)
    assert big[:16] == small
    assert len(set(big)) == 256


def test_missing_file_is_config_error(tmp_path):
    with pytest.raises(ConfigError) as e:
        build_tokenizer(str(tmp_path / "nope.model"))
    msg = str(e.value)
    assert "model.tokenizer_path" in msg and "scripts/train_tokenizer.py" in msg and "\n" not in msg


@pytest.mark.parametrize("content", [b"not base64!! 0\n", b"YQ== 0\nYg== 5\n", b"", b"YQ== 0\n"])
def test_malformed_file_is_config_error(tmp_path, content):
    path = tmp_path / "bad.model"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="model.tokenizer_path"):
        build_tokenizer(str(path))


def test_no_tiktoken_cache_copy(tmp_path, monkeypatch):
    cache = tmp_path / "tiktoken_cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    build_tokenizer(DEBUG_TOKENIZER)
    assert not cache.exists() or not any(cache.iterdir())


def test_train_bpe_small_corpus(tmp_path):
    mod = _load_script("train_tokenizer")
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(2, 8))) for _ in range(60)]
    docs = [" ".join(rng.choice(words) for _ in range(300)) + ". ünïcode üü" for _ in range(5)]
    docs.append("the cat sat on the mat. " * 20)
    counts = mod.count_chunks(docs)
    assert counts[b" the"] > 0
    ranks = mod.train_bpe(counts, 300, log_every=0)
    assert len(ranks) == 300 and sorted(ranks.values()) == list(range(300))
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert ranks == mod.train_bpe(counts, 300, log_every=0)  # deterministic
    # the most frequent adjacent byte pair is merged first
    pair_counts: Counter = Counter()
    for chunk, n in counts.items():
        for a, b in zip(chunk, chunk[1:]):
            pair_counts[bytes([a, b])] += n
    top = max(pair_counts.values())
    first = next(t for t, r in ranks.items() if r == 256)
    assert pair_counts[first] == top
    path = str(tmp_path / "t.model")
    write_tiktoken_file(path, ranks)
    tok = build_tokenizer(path)
    assert tok.vocab_size == 316
    assert tok.decode(tok.encode(docs[0] + UNICODE_TEXT)) == docs[0] + UNICODE_TEXT
    assert len(tok.encode(docs[0])) < 0.7 * len(docs[0])
    with pytest.raises(RuntimeError, match="corpus too small"):
        mod.train_bpe(Counter({b"ab": 1}), 300, log_every=0)


def test_debug_asset_is_tiktoken_format():
    with open(DEBUG_TOKENIZER, "rb") as f:
        lines = f.read().splitlines()
    assert len(lines) == 2032
    for rank, line in enumerate(lines):
        b64, r = line.split()
        assert int(r) == rank
        base64.b64decode(b64, validate=True)


def test_download_script_offline_error(tmp_path, monkeypatch):
    mod = _load_script("download_tokenizer")
    monkeypatch.setattr(mod, "_have_hf_hub", lambda: False)

    def no_network(*a, **k):
        import urllib.error
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(mod.urllib.request, "urlopen", no_network)
    with pytest.raises(SystemExit) as e:
        mod.main(["--repo_id", "meta-llama/Llama-3.1-8B", "--hf_token", "x", "--local_dir", str(tmp_path)])
    assert "huggingface.co" in str(e.value.code)
    assert not list(tmp_path.iterdir())  # no partial file left behind


def test_each_shipped_configs_missing_tokenizer_error_gives_the_command_that_puts_it_there(tmp_path, monkeypatch):
    """A shipped GPU config names a tokenizer the repo does not hold: its one-line error gives
    the download command, and that command (the Hub replaced by a local file) saves the
    tokenizer exactly where the config looks, where it then loads."""
    import shlex
    import tomllib
    from pathlib import Path

    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import WordLevel

    from trainer.data import tokenizer as tokenizer_module

    mod = _load_script("download_tokenizer")
    word_level = tmp_path / "tokenizer.json"
    RustTokenizer(WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(word_level))
    fetched = []

    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "a"}')

    def fake_fetch(repo_id, filename, token, revision, dest):
        fetched.append((repo_id, filename))
        source = {"tokenizer.json": word_level, "tokenizer_config.json": tmp_path / "tokenizer_config.json"}.get(
            filename, DEBUG_TOKENIZER)
        with open(source, "rb") as src, open(dest, "wb") as out:
            out.write(src.read())

    monkeypatch.setattr(mod, "_have_hf_hub", lambda: False)
    monkeypatch.setattr(mod, "_fetch_with_urllib", fake_fetch)
    # The repo's assets/ stands in as tmp_path: nothing is written into the checkout.
    monkeypatch.setattr(tokenizer_module, "_REPO_ROOT", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    checked = set()
    for config in sorted(Path(REPO, "train_configs").glob("*.toml")):
        path = tomllib.loads(config.read_text()).get("model", {}).get("tokenizer_path")
        if not path or os.path.exists(os.path.join(REPO, path)):
            continue
        if os.path.exists(path):  # fetched for an earlier config (llama3: 8B, 70B and 405B share it)
            assert build_tokenizer(path).vocab_size > 0
            continue
        with pytest.raises(ConfigError) as e:
            build_tokenizer(path)
        message = str(e.value)
        assert "\n" not in message and f"at {path!r}" in message, message
        command = shlex.split(message.split("`")[1])
        assert command[:2] == ["python", "scripts/download_tokenizer.py"], message
        args = [a for a in command[2:] if a not in ("--hf_token", "<token>")]
        mod.main(args)
        assert build_tokenizer(path).vocab_size > 0, config.name  # the config's own path now loads
        checked.add(os.path.dirname(path))
    assert checked == set(tokenizer_module.SHIPPED_TOKENIZERS), checked  # every shipped folder, no stale entry
    assert {r for r, _ in fetched} == {"meta-llama/Llama-3.1-8B", "deepseek-ai/DeepSeek-V2-Lite",
                                       "deepseek-ai/DeepSeek-V3", "Qwen/Qwen3-8B-Base"}
