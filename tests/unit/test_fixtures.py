"""A test whose fixture is missing skips in a user's clone but fails under CI=true."""

from __future__ import annotations

import pytest
from conftest import require_fixture


def test_a_missing_fixture_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="fixture missing under CI=true: the data"):
        require_fixture(False, "the data")
    require_fixture(True, "the data")  # present: nothing happens


def test_a_missing_fixture_skips_elsewhere(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="the data not in this checkout"):
        require_fixture(False, "the data")
