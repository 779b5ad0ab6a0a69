"""Process-level overrides of the launch-configuration tables, shared by every op with one.

An op resolves its configuration as: the ``config=`` argument if given, else its measured
default; then the fields set for the op here replace the default's. Overrides are set with
:func:`set_config_override` / :func:`config_override` (checked against the config's fields
when set), or once at import from ``TILEFUSE_<OP>_CONFIG="field=value,..."`` for experiments.
Nothing reads the environment per call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, TypeVar

C = TypeVar("C")
_TRUE = ("1", "true", "yes", "on")

# op name -> (config class, {field: value}) of the fields overridden now.
_config_classes: dict[str, type] = {}
_overrides: dict[str, dict[str, Any]] = {}


def _checked_fields(op: str, fields: dict[str, Any]) -> dict[str, Any]:
    cls = _config_classes.get(op)
    if cls is None:
        raise ValueError(f"config override: unknown op {op!r}; ops are {sorted(_config_classes)}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in fields.items():
        if key not in known:
            raise ValueError(f"{op} config override: unknown field {key!r}; fields are {sorted(known)}")
        default = known[key].default
        kind = bool if isinstance(default, bool) else type(default)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise TypeError(f"{op} config override: {key} needs {kind.__name__}, got {value!r}")
    return dict(fields)


def _parse_env(op: str, spec: str) -> dict[str, Any]:
    cls = _config_classes[op]
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    env = f"TILEFUSE_{op.upper()}_CONFIG"
    fields = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key not in defaults:
            raise ValueError(f"{env}: unknown field {key!r}; fields are {sorted(defaults)}")
        if isinstance(defaults[key], bool):
            fields[key] = value.lower() in _TRUE
        else:
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"{env}: {key} needs an int, got {value!r}") from None
    return fields


def register_config(op: str, cls: type) -> None:
    """Make ``op``'s config class known; reads ``TILEFUSE_<OP>_CONFIG`` once, now."""
    _config_classes[op] = cls
    spec = os.environ.get(f"TILEFUSE_{op.upper()}_CONFIG", "").strip()
    if spec:
        _overrides[op] = _parse_env(op, spec)


def set_config_override(op: str, **fields) -> None:
    """Replace these fields of ``op``'s configuration in every later call (no fields: clear)."""
    if fields:
        _overrides[op] = _checked_fields(op, fields)
    else:
        _checked_fields(op, {})
        _overrides.pop(op, None)


@contextlib.contextmanager
def config_override(op: str, **fields):
    """:func:`set_config_override` for the duration of a ``with`` block."""
    old = _overrides.get(op)
    set_config_override(op, **fields)
    try:
        yield
    finally:
        if old is None:
            _overrides.pop(op, None)
        else:
            _overrides[op] = old


def apply_override(cfg: C, op: str) -> C:
    """``cfg`` with ``op``'s overridden fields replaced (a dict lookup when there are none)."""
    fields = _overrides.get(op)
    return dataclasses.replace(cfg, **fields) if fields else cfg
