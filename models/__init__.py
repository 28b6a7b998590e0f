"""Model registry: `model.name` -> `ModelSpec`, looked up lazily.

Built-in models are imported only when first asked for, so `--help` or a Llama run
never imports DeepSeek code. A model outside this repo registers itself with
`register_model_spec(spec)`, or is named by its module path (`--model.name
mypkg.mymodel`), which is imported and must export `spec`. Adding a model to the
repo means adding a folder `models/<name>/` exporting `spec`, and one line in
`_BUILTIN`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from models.spec import ModelSpec

_BUILTIN = {"llama3": "models.llama3", "deepseek_v3": "models.deepseek_v3", "qwen3": "models.qwen3"}
_REGISTERED: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Makes `spec` available under `spec.name` (for models that live outside `models/`)."""
    _REGISTERED[spec.name] = spec
    return spec


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered as `name`; a built-in name or a module path is imported first.
    Raises KeyError for an unknown name."""
    if name not in _REGISTERED:
        module = _BUILTIN.get(name, name if "." in name else None)
        if module is None:
            raise KeyError(name)
        try:
            spec = importlib.import_module(module).spec
        except ModuleNotFoundError as e:
            if e.name is not None and module.startswith(e.name):
                raise KeyError(name) from None
            raise
        _REGISTERED.setdefault(name, spec)
    return _REGISTERED[name]


def model_names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_REGISTERED))


class _LazySpecs(Mapping):
    """Read-only name -> spec view of the registry (imports a built-in on first access)."""

    def __getitem__(self, name: str) -> ModelSpec:
        return get_model_spec(name)

    def __iter__(self) -> Iterator[str]:
        return iter(model_names())

    def __len__(self) -> int:
        return len(model_names())

    def __contains__(self, name: object) -> bool:
        try:
            get_model_spec(str(name))
            return True
        except KeyError:
            return False


MODEL_SPECS: Mapping[str, ModelSpec] = _LazySpecs()
