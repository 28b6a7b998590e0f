"""The review's small findings (issue 19, part 4), each with the test that failed before its fix:

- list-of-tables fields (data.sources, validation.sources) on the command line are TOML
  inline arrays, checked as in a file (they were split at commas);
- a duplicate TOML key names the key (tomllib gives only line and column).
"""

from __future__ import annotations

import pytest

from tests.helpers import TINY, read_metrics, run_in_process
from trainer.config import load_config
from configuration.fields import ConfigError


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_DATA_CACHE", str(tmp_path / "cache"))


def _text(path, seed: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "tau", "rho"]
    lines = [" ".join(words[(seed + i * j) % len(words)] for j in range(12)) for i in range(400)]
    path.write_text("\n\n".join(lines) + "\n")
    return str(path)


def test_cli_mixture_is_a_toml_inline_array_and_draws_70_30(tmp_path):
    """`--data.sources "[{path='A', weight=0.7}, {path='B', weight=0.3}]"` trains on the
    mixture: over 1,000 windows the logged data/tokens/<name> are 70/30 within 2%."""
    a, b = _text(tmp_path / "a.txt", 1), _text(tmp_path / "b.txt", 2)
    mixture = f"[{{path='{a}', weight=0.7}}, {{path='{b}', weight=0.3}}]"
    args = [*TINY, "--data.sources", mixture, "--training.seq_len", "16", "--training.local_batch_size", "100",
            "--training.steps", "10", "--metrics.log_freq", "10", "--job.dump_folder", str(tmp_path / "run")]
    cfg = load_config(args)
    assert [(s.name, s.weight) for s in cfg.data.source_specs()] == [("a.txt", 0.7), ("b.txt", 0.3)]
    run_in_process(args)
    last = read_metrics(tmp_path / "run")[-1]
    tokens_a, tokens_b = last["data/tokens/a.txt"], last["data/tokens/b.txt"]
    assert tokens_a + tokens_b == 1000 * 16
    assert abs(tokens_a / (tokens_a + tokens_b) - 0.7) <= 0.02 * 0.7, (tokens_a, tokens_b)
    # the comma-separated form still works (weight 1 each)
    cfg = load_config(["--data.sources", f"{a},{b}"])
    assert [(s.name, s.weight) for s in cfg.data.source_specs()] == [("a.txt", 1.0), ("b.txt", 1.0)]


@pytest.mark.parametrize("key", ["data.sources", "validation.sources"])
@pytest.mark.parametrize("value, fragment", [
    ("[{path='/d/a', weight=0.7}, {path='/d/b', weight=-0.3}]", "[1].weight: expected a positive number, got -0.3"),
    ("[{path='/d/a', weight=0}]", "[0].weight: expected a positive number, got 0"),
    ("[{path='/d/a', wieght=0.7}]", "[0]: unknown key(s) ['wieght']"),
    ("[{path=/d/a, weight=0.7}]", ": malformed TOML inline array"),
    ("[{path='/d/a', weight=0.7}", ": malformed TOML inline array"),
    ("[1, 2]", "[0]: expected a table with path and weight, got 1"),
])
def test_cli_list_of_tables_errors_name_the_field(key, value, fragment):
    extra = ["--validation.enable", "true"] if key.startswith("validation") else []
    with pytest.raises(ConfigError) as e:
        load_config([f"--{key}", value, *extra])
    message = str(e.value)
    assert message.startswith(f"config error: {key}") and fragment in message and "\n" not in message, message


def test_cli_validation_sources_inline_array(tmp_path):
    cfg = load_config(["--validation.enable", "true", "--validation.sources",
                       "[{type='synthetic', name='held', weight=2}]"])
    assert [(s.type, s.name, s.weight) for s in cfg.validation.specs(cfg.data)] == [("synthetic", "held", 2.0)]


def test_duplicate_toml_key_is_named(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[training]\nsteps = 3\nseq_len = 64\n[optimizer]\nlr = 1e-3\n[data]\ntype = "builtin"\n'
                    '[training]\n')
    with pytest.raises(ConfigError, match=r"Cannot declare \('training',\) twice"):
        load_config(["--config", str(toml)])
    toml.write_text('[training]\nsteps = 3\nseq_len = 64\n"steps" = 4\n[optimizer]\nlr = 1e-3\n')
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(toml)])
    message = str(e.value)
    assert "line 4, column" in message and "the key is training.steps, set before on line 2" in message, message
    toml.write_text('model.name = "llama3"\nmodel.name = "x"\n')
    with pytest.raises(ConfigError, match=r"the key is model.name, set before on line 1$"):
        load_config(["--config", str(toml)])
