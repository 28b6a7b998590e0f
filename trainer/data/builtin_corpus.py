"""The "builtin" corpus: docstrings of this Python installation's standard library.

Every machine that runs the trainer has the stdlib sources, so this gives a few
hundred thousand tokens of English (with some code) without a download and
without shipping anyone's text in the repo. Sources are parsed with `ast`, never
imported (importing e.g. `antigravity` or `this` has side effects). Test suites,
IDLE, demos, bundled wheels and site-packages are skipped. Order is fixed: files
sorted by relative path, docstrings in source order (module, then classes and
functions depth-first), exact duplicates dropped after their first occurrence.
"""

from __future__ import annotations

import ast
import os
import sysconfig
import tokenize
from collections.abc import Iterator

# Directory names skipped anywhere under the stdlib root.
SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "turtledemo", "__pycache__",
    "ensurepip", "lib-dynload", "__phello__", "pydoc_data", "Tools", "venv",
})


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _skip_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith(("config-", ".")) or name.endswith(".dist-info")


def stdlib_source_files(root: str | None = None) -> list[str]:
    """The stdlib .py files used for the corpus, sorted by path relative to `root`."""
    root = root or stdlib_root()
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not _skip_dir(x))
        for f in sorted(files):
            if f.endswith(".py") and not f.startswith(("test_", "_test")) and f != "conftest.py":
                out.append(os.path.join(d, f))
    return sorted(out, key=lambda p: os.path.relpath(p, root))


def _docstrings(tree: ast.AST) -> Iterator[str]:
    """Docstrings of a module and its classes/functions, depth-first in source order."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and doc.strip():
                yield doc.strip()
        children = [c for c in ast.iter_child_nodes(node)
                    if isinstance(c, (ast.stmt, ast.excepthandler, ast.match_case)) and hasattr(c, "body")]
        stack.extend(reversed(children))


def file_docstrings(path: str) -> list[str]:
    """Docstrings of one source file; [] if it cannot be read or parsed."""
    try:
        with tokenize.open(path) as f:  # honours PEP 263 coding cookies
            source = f.read()
        tree = ast.parse(source, filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    return list(_docstrings(tree))


def builtin_documents(root: str | None = None, max_files: int | None = None) -> list[str]:
    """All corpus documents (one per docstring), deduplicated, in a fixed order."""
    seen: set[str] = set()
    docs: list[str] = []
    files = stdlib_source_files(root)
    if max_files is not None:
        files = files[:max_files]
    for path in files:
        for doc in file_docstrings(path):
            if doc not in seen:
                seen.add(doc)
                docs.append(doc)
    return docs
