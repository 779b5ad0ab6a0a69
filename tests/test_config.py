"""Environment overrides of launch configurations."""

import dataclasses

import pytest

from tilefuse._config import apply_env_overrides


@dataclasses.dataclass(frozen=True)
class Cfg:
    block: int = 64
    fast: bool = False


def test_overrides_ints_and_flags(monkeypatch):
    monkeypatch.setenv("X_CFG", " block=128 , fast=yes")
    assert apply_env_overrides(Cfg(), "X_CFG") == Cfg(128, True)
    monkeypatch.setenv("X_CFG", "fast=0")
    assert apply_env_overrides(Cfg(fast=True), "X_CFG") == Cfg(64, False)
    monkeypatch.delenv("X_CFG")
    assert apply_env_overrides(Cfg(32), "X_CFG") == Cfg(32)


@pytest.mark.parametrize("spec,match", [("blok=3", "unknown field 'blok'"), ("block=big", "needs an int")])
def test_bad_overrides_name_the_variable(monkeypatch, spec, match):
    monkeypatch.setenv("X_CFG", spec)
    with pytest.raises(ValueError, match=f"X_CFG: .*{match}"):
        apply_env_overrides(Cfg(), "X_CFG")
