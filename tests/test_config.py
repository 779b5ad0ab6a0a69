"""Process-level overrides of launch configurations."""

import dataclasses

import pytest

from tilefuse import _config


@dataclasses.dataclass(frozen=True)
class Cfg:
    block: int = 64
    fast: bool = False


@pytest.fixture
def op(monkeypatch):
    monkeypatch.setattr(_config, "_config_classes", {})
    monkeypatch.setattr(_config, "_overrides", {})
    _config.register_config("xop", Cfg)
    return "xop"


def test_setter_and_context_manager(op):
    assert _config.apply_override(Cfg(32), op) == Cfg(32)
    _config.set_config_override(op, block=128, fast=True)
    assert _config.apply_override(Cfg(), op) == Cfg(128, True)
    with _config.config_override(op, block=16):
        assert _config.apply_override(Cfg(), op) == Cfg(16)
    assert _config.apply_override(Cfg(), op) == Cfg(128, True)
    _config.set_config_override(op)
    assert _config.apply_override(Cfg(8), op) == Cfg(8)


@pytest.mark.parametrize("fields,exc,match", [({"blok": 3}, ValueError, "unknown field 'blok'"),
                                              ({"block": "big"}, TypeError, "block needs int"),
                                              ({"block": True}, TypeError, "block needs int")])
def test_bad_overrides_are_refused_when_set(op, fields, exc, match):
    with pytest.raises(exc, match=match):
        _config.set_config_override(op, **fields)
    assert _config.apply_override(Cfg(), op) == Cfg()


def test_unknown_op(op):
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        _config.set_config_override("nope", block=1)


def test_environment_is_read_once_at_registration(monkeypatch):
    monkeypatch.setattr(_config, "_config_classes", {})
    monkeypatch.setattr(_config, "_overrides", {})
    monkeypatch.setenv("TILEFUSE_YOP_CONFIG", " block=128 , fast=yes")
    _config.register_config("yop", Cfg)
    monkeypatch.delenv("TILEFUSE_YOP_CONFIG")
    assert _config.apply_override(Cfg(), "yop") == Cfg(128, True)
    monkeypatch.setenv("TILEFUSE_YOP_CONFIG", "blok=3")
    with pytest.raises(ValueError, match="TILEFUSE_YOP_CONFIG: unknown field 'blok'"):
        _config.register_config("yop", Cfg)
