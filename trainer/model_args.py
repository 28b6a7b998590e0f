"""Model args, resolved once: `model.name` + `model.flavor` (later also an HF folder and
config overrides) -> the spec and the exact args every consumer uses.

`JobConfig.validate` calls `resolve_model` once and keeps the result; the trainer, the
parallelism checks, the dry run and the memory estimator all read `cfg.model_spec` and
`cfg.model_args` instead of looking the flavor up again, so a field that changes the
shape is applied in exactly one place.
"""

from __future__ import annotations

import difflib
from typing import Any

from trainer.configurable import ConfigError


def unknown_value(key: str, value: str, valid: list[str], where: str = "") -> str:
    close = difflib.get_close_matches(value, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"config error: {key}: unknown value {value!r}{where}{hint}; valid: {', '.join(valid)}"


def resolve_model(cfg) -> tuple[Any, Any]:
    """(ModelSpec, model args) for the `[model]` section of `cfg`, or a one-line ConfigError."""
    from models import get_model_spec, model_names

    name = cfg.model.name
    try:
        spec = get_model_spec(name)
    except KeyError:
        raise ConfigError(unknown_value("model.name", name, model_names())) from None
    if cfg.model.flavor not in spec.flavors:
        raise ConfigError(unknown_value("model.flavor", cfg.model.flavor, list(spec.flavors), f" for {name}"))
    return spec, spec.flavors[cfg.model.flavor]
