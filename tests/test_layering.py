"""Import rules between the three packages, checked with `ast` (no imports are executed).

- model code (`models/*/model.py`, `models/common/`) imports nothing from `trainer` or
  `parallelisms`: parallelism is applied from outside, by plans;
- `parallelisms` imports from `trainer` only the stdlib-only config leaf
  (`trainer.configurable`);
- nothing in `models` or `parallelisms` imports `trainer.train`;
- the config leaf imports nothing but the standard library.
Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

CONFIG_LEAF = "trainer.configurable"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            # `from trainer import train` imports trainer.train
            out.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return out


def _files(*globs: str) -> list[Path]:
    return sorted({p for g in globs for p in REPO.glob(g)})


def _violations(files: list[Path], forbidden) -> list[str]:
    bad = []
    for path in files:
        for line, module in imported_modules(path):
            if forbidden(module):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    return bad


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_model_code_knows_nothing_of_trainer_or_parallelisms():
    files = _files("models/*/model.py", "models/common/**/*.py")
    assert len(files) >= 6
    assert not _violations(files, lambda m: _under(m, "trainer") or _under(m, "parallelisms"))


def test_parallelisms_import_only_the_config_leaf_from_trainer():
    files = _files("parallelisms/**/*.py")
    assert len(files) >= 8
    assert not _violations(files, lambda m: _under(m, "trainer") and m not in ("trainer", CONFIG_LEAF)
                           and not m.startswith(CONFIG_LEAF + "."))


def test_nothing_in_models_or_parallelisms_imports_the_training_loop():
    files = _files("models/**/*.py", "parallelisms/**/*.py")
    assert not _violations(files, lambda m: _under(m, "trainer.train"))


def test_config_leaf_is_stdlib_only():
    leaf = REPO / (CONFIG_LEAF.replace(".", "/") + ".py")
    stdlib = sys.stdlib_module_names | {"__future__"}
    bad = [m for _, m in imported_modules(leaf) if m.split(".")[0] not in stdlib]
    assert not bad, bad


def test_every_environment_knob_the_code_names_is_documented():
    """Our own knobs (AC_TRACE, TITAN_*) live in ENV_KNOBS, which the README reference lists."""
    import re

    from trainer.configurable import ENV_KNOBS

    files = _files("trainer/**/*.py", "models/**/*.py", "parallelisms/**/*.py", "scripts/*.py") + [REPO / "run_train.sh"]
    named = {m for f in files for m in re.findall(r"\b(AC_TRACE|TITAN_[A-Z_]+)\b", f.read_text())}
    assert {"AC_TRACE", "TITAN_CHECKPOINT_CRASH_AT"} <= named
    assert not named - set(ENV_KNOBS), f"add to trainer/configurable.py ENV_KNOBS: {sorted(named - set(ENV_KNOBS))}"
    readme = (REPO / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in ENV_KNOBS), "run scripts/config_reference.py into README.md"


@pytest.mark.parametrize("source, forbidden", [
    ("import trainer.train\n", "trainer.train"),
    ("def f():\n    from trainer.data import build_dataloader\n", "trainer.data"),
    ("from ..trainer import train\n", "trainer.train"),
])
def test_the_checker_sees_every_import_form(tmp_path, source, forbidden, monkeypatch):
    """The rules above can fail: top-level, function-local and relative imports are all seen."""
    pkg = tmp_path / "parallelisms"
    pkg.mkdir()
    (pkg / "x.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    mods = [m for _, m in imported_modules(pkg / "x.py")]
    assert any(_under(m, forbidden) for m in mods), mods
