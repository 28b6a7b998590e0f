"""Machinery for typed config sections.

Each component owns a small dataclass for the TOML section it reads, built with
`opt(...)` so that every field carries its doc, its allowed values and its range.
`trainer.config` composes the sections into one root, loads TOML and applies
`--section.key value` overrides; all checking happens here, at load time, so a
bad value fails in one line before any process group or model exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import field
from typing import Any, Callable


class ConfigError(ValueError):
    """A bad config value. Its message is one line that names the key and the fix."""


def opt(default: Any, doc: str, *, choices: tuple | None = None, min: float | None = None,
        max: float | None = None, parse: Callable[[Any], Any] | None = None):
    """A config field. `parse` (optional) normalises a raw TOML/CLI value and raises
    ValueError with a helpful message on bad input; it runs before type checking."""
    meta = {"doc": doc, "choices": choices, "min": min, "max": max, "parse": parse}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def _strip_optional(tp) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def type_name(tp) -> str:
    base, optional = _strip_optional(tp)
    name = getattr(base, "__name__", str(base))
    if typing.get_origin(base) is list:
        name = str(base).replace("typing.", "")
    return f"{name} | None" if optional else name


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def coerce(key: str, tp, value: Any, from_cli: bool) -> Any:
    """Converts `value` (a TOML value, or a string from the CLI) to `tp`, or raises ConfigError."""
    base, optional = _strip_optional(tp)
    if optional and (value is None or (from_cli and isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    bad = ConfigError(f"config error: {key}: expected {type_name(tp)}, got {value!r}")
    if base is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad
    if base is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad from None
        raise bad
    if base is float:
        if isinstance(value, bool):
            raise bad
        if from_cli and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise bad from None
        if not isinstance(value, (int, float)):
            raise bad
        # nan passes every range check (nan < min is False), and inf means a typo or an
        # overflow ("1e999"): neither is a setting.
        if not math.isfinite(value):
            raise ConfigError(f"config error: {key}: {value!r} is not a finite number; give a finite value")
        return float(value)
    if base is str:
        if isinstance(value, str):
            return value
        raise bad
    if typing.get_origin(base) is list:
        (item_tp,) = typing.get_args(base)
        if from_cli and isinstance(value, str) and value.strip().startswith("["):
            value = toml_inline_array(key, value)  # e.g. "[{path='/d/a', weight=0.7}, {path='/d/b'}]"
        elif from_cli and isinstance(value, str):
            # Nested lists on the CLI: ";" separates the outer items, "," the inner ones.
            sep = ";" if typing.get_origin(item_tp) is list else ","
            value = [v.strip() for v in value.split(sep) if v.strip()]
        if not isinstance(value, list):
            raise bad
        return [coerce(f"{key}[{i}]", item_tp, v, from_cli) for i, v in enumerate(value)]
    if base is typing.Any:
        return value
    raise TypeError(f"unsupported config type {tp} for {key}")


def toml_inline_array(key: str, text: str) -> list:
    """A command-line list written as a TOML inline array (how a list of tables such as
    data.sources is given on the CLI), parsed as TOML would parse it in a file; then the
    field's own checks apply as for a file. A malformed one is one ConfigError naming `key`."""
    import tomllib

    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as e:
        reason = str(e).split(" (at line")[0]
        raise ConfigError(f"config error: {key}: malformed TOML inline array {text!r} ({reason}); write e.g. "
                          "\"[{path='/d/a', weight=0.7}, {path='/d/b', weight=0.3}]\" (strings quoted)") from None
    if not isinstance(value, list):  # e.g. "[1] x" fails above; belt and braces
        raise ConfigError(f"config error: {key}: expected a TOML inline array, got {text!r}")
    return value


def check_value(key: str, f: dataclasses.Field, value: Any) -> None:
    meta = f.metadata
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"config error: {key}: {value!r} is not one of {', '.join(map(str, choices))}{hint}")
    lo, hi = meta.get("min"), meta.get("max")
    if value is not None and not isinstance(value, (list, str)):
        if lo is not None and value < lo:
            raise ConfigError(f"config error: {key}: {value} is below the minimum {lo}")
        if hi is not None and value > hi:
            raise ConfigError(f"config error: {key}: {value} is above the maximum {hi}")


def set_field(section_obj: Any, section: str, name: str, value: Any, from_cli: bool) -> None:
    fields = {f.name: f for f in dataclasses.fields(section_obj)}
    key = f"{section}.{name}"
    if name not in fields:
        close = difflib.get_close_matches(name, list(fields), n=1)
        hint = f" (did you mean {section}.{close[0]}?)" if close else f"; valid keys: {', '.join(fields)}"
        raise ConfigError(f"config error: unknown key {key}{hint}")
    f = fields[name]
    hints = typing.get_type_hints(type(section_obj))
    parse = f.metadata.get("parse")
    if parse is not None:
        try:
            value = parse(value)
        except ValueError as e:
            raise ConfigError(f"config error: {key}: {e}") from None
    value = coerce(key, hints[name], value, from_cli)
    check_value(key, f, value)
    setattr(section_obj, name, value)


def field_docs(section_obj_or_cls: Any) -> list[tuple[str, str, Any, str]]:
    """(name, type name, default, doc) for every field of a section, for --help."""
    cls = section_obj_or_cls if isinstance(section_obj_or_cls, type) else type(section_obj_or_cls)
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        doc = f.metadata.get("doc", "")
        if f.metadata.get("choices"):
            doc += f" One of: {', '.join(map(str, f.metadata['choices']))}."
        out.append((f.name, type_name(hints[f.name]), default, doc))
    return out
