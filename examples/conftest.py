"""Shared fixtures of the example suite: resolved on every rank, as under torchrun."""

import pytest


@pytest.fixture(scope="session")
def hidden_size() -> int:
    return 16
