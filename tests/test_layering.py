"""Import rules between the packages, checked with `ast` (no imports are executed).

- model code (`models/*/model.py`, `models/common/`) imports nothing from `trainer` or
  `parallelisms`, nor DTensor: parallelism is applied from outside, by plans;
- `parallelisms` imports nothing from `trainer`: its config fields come from the
  stdlib-only config leaf, the `configuration` package below both;
- nothing in `models` or `parallelisms` imports `trainer.train`;
- the config leaf imports nothing but the standard library;
- no two of our modules import each other, directly or around a circle.
Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

CONFIG_LEAF = "configuration"
OUR_PACKAGES = ("trainer", "models", "parallelisms", "planner", "configuration")


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


def test_model_code_does_not_handle_dtensors():
    """The layers compute on the tensors they are given: a plan that makes weights DTensors
    gives the layer the local ones (e.g. `GroupedExperts.local_weights`, set by EP and TP)."""
    files = _files("models/*/model.py", "models/common/**/*.py")
    assert not _violations(files, lambda m: _under(m, "torch.distributed.tensor"))


def test_parallelisms_import_nothing_from_trainer():
    files = _files("parallelisms/**/*.py")
    assert len(files) >= 8
    assert not _violations(files, lambda m: _under(m, "trainer"))


def test_nothing_in_models_or_parallelisms_imports_the_training_loop():
    files = _files("models/**/*.py", "parallelisms/**/*.py")
    assert not _violations(files, lambda m: _under(m, "trainer.train"))


def test_config_leaf_is_stdlib_only():
    leaf = _files(f"{CONFIG_LEAF}/*.py")
    assert len(leaf) >= 3
    stdlib = sys.stdlib_module_names | {"__future__"}
    bad = [f"{p.name}: {m}" for p in leaf for _, m in imported_modules(p)
           if m.split(".")[0] not in stdlib and not _under(m, CONFIG_LEAF)]
    assert not bad, bad


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_cycles(files: list[Path]) -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph among `files`
    (an import resolves to the longest module of ours it names; a module importing its own
    package's `__init__` is not an edge)."""
    modules = {module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for _, target in imported_modules(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                deps.add(target)
        graph[name] = deps
    # Tarjan's algorithm, iteratively (no recursion limit on a deep graph).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
    return cycles


def test_no_import_cycles():
    files = _files(*(f"{pkg}/**/*.py" for pkg in OUR_PACKAGES))
    assert len(files) >= 60
    assert not import_cycles(files)


def test_the_cycle_finder_finds_a_lazy_circle(tmp_path, monkeypatch):
    """The rule above can fail: a circle closed by a function-local import is found."""
    pkg = tmp_path / "trainer"
    pkg.mkdir()
    (pkg / "a.py").write_text("from trainer.b import x\n")
    (pkg / "b.py").write_text("def x():\n    from trainer.c import y\n")
    (pkg / "c.py").write_text("import trainer.a\n")
    (pkg / "d.py").write_text("from trainer import a\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert import_cycles(sorted(pkg.glob("*.py"))) == [["trainer.a", "trainer.b", "trainer.c"]]


def test_every_environment_knob_the_code_names_is_documented():
    """Our own knobs (AC_TRACE, TITAN_*) live in ENV_KNOBS, which the README reference lists."""
    import re

    from configuration.environment import ENV_KNOBS

    files = _files("trainer/**/*.py", "models/**/*.py", "parallelisms/**/*.py", "scripts/*.py") + [REPO / "run_train.sh"]
    named = {m for f in files for m in re.findall(r"\b(AC_TRACE|TITAN_[A-Z_]+)\b", f.read_text())}
    assert {"AC_TRACE", "TITAN_CHECKPOINT_CRASH_AT"} <= named
    assert not named - set(ENV_KNOBS), f"add to configuration/environment.py ENV_KNOBS: {sorted(named - set(ENV_KNOBS))}"
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
