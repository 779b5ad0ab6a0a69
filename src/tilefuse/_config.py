"""Launch-configuration overrides from the environment, shared by every op with a config table."""

from __future__ import annotations

import dataclasses
import os
from typing import TypeVar

C = TypeVar("C")
_TRUE = ("1", "true", "yes", "on")


def apply_env_overrides(cfg: C, env: str) -> C:
    """``cfg`` with the fields named in ``$env`` (``"field=value,field=value"``) replaced.

    Booleans take 1/true/yes/on (anything else is False), every other field an int. Meant for
    experiments: production callers pass a config object instead.

    Raises:
        ValueError: a field the config does not have, or a value that is not an int.
    """
    spec = os.environ.get(env, "").strip()
    if not spec:
        return cfg
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    updates = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key not in fields:
            raise ValueError(f"{env}: unknown field {key!r}; fields are {sorted(fields)}")
        if isinstance(fields[key], bool):
            updates[key] = value.lower() in _TRUE
        else:
            try:
                updates[key] = int(value)
            except ValueError:
                raise ValueError(f"{env}: {key} needs an int, got {value!r}") from None
    return dataclasses.replace(cfg, **updates)
