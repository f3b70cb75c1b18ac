"""Fixtures the CLI tests share."""

from __future__ import annotations

import sys
import types

import pytest

from doracheck.properties.unsupported import Unsupported


@pytest.fixture
def na_module(monkeypatch):
    """The name of an importable module whose ``never`` implementation supports nothing (every
    call raises ``Unsupported``): ``--impl NAME:never`` has nothing checkable."""
    module = types.ModuleType("doracheck_test_na_impl")

    def never(*args, **kwargs):
        raise Unsupported("this implementation supports nothing")

    module.never = never
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__name__
