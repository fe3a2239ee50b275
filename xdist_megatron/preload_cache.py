"""What the zygote preloaded last session, kept in the pytest cache so the next session's zygote
can start importing before collection instead of after it (the imports then overlap)."""

from __future__ import annotations

import pytest

CACHE_KEY = "xdist_megatron/preload"


def load(config: pytest.Config) -> list[str] | None:
    """The detected preloads of the last session that ran gangs; None if none is remembered."""
    cache = getattr(config, "cache", None)
    if cache is None:
        return None
    value = cache.get(CACHE_KEY, None)
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        return None
    return value


def save(config: pytest.Config, modules: list[str]) -> None:
    cache = getattr(config, "cache", None)
    if cache is not None and load(config) != modules:
        cache.set(CACHE_KEY, modules)
