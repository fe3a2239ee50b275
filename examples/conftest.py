"""Shared fixtures of the example suite: resolved in the driver, pickled to every rank."""

import pytest


@pytest.fixture(scope="session")
def hidden_size() -> int:
    return 16
