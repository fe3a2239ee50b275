"""The pytest cache, read before its plugin is configured: `-n auto` is decided, and the import
follower starts the zygote, while the conftest files are still being imported. It reads where the
cache plugin keeps each value: `<cache_dir>/v/<key>`, JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def value(config: pytest.Config, key: str) -> object:
    """The cached value of `key`; None without a cache, with --cache-clear, or when unreadable."""
    cache = getattr(config, "cache", None)
    if cache is not None:
        return cache.get(key, None)
    try:
        folder = Path(os.path.expanduser(os.path.expandvars(config.getini("cache_dir"))))
    except ValueError:  # -p no:cacheprovider: no such ini
        return None
    if config.getoption("cacheclear", False):
        return None
    try:
        return json.loads((config.rootpath / folder / "v" / key).read_text())
    except (OSError, ValueError):
        return None
