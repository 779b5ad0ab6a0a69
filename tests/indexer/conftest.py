"""Fixtures shared by the indexer tests."""

from __future__ import annotations

import pytest
import torch

import tilefuse
from tilefuse import _errors


@pytest.fixture
def poisoned(monkeypatch):
    """Every fresh allocation starts as NaN, so an element the kernel skips shows up."""
    real = torch.empty_strided

    def nan_filled(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty_strided", nan_filled)


@pytest.fixture
def no_pending_errors():
    """The test starts with no device value error recorded and must leave none behind (a test
    that expects one takes it with ``tilefuse.check_errors()``)."""
    for record in _errors._records.values():
        record.zero_()
    yield
    tilefuse.check_errors()
