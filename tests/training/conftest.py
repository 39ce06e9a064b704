"""Fixtures shared by the guard's test modules."""

from __future__ import annotations

import pytest
from guard_helpers import Run, train


@pytest.fixture(scope="session")
def clean() -> Run:
    """A clean 300-step run with every detector on, every window verified at rest."""
    return train(300, check_every=10, per_layer=True, update_ratio=True)
