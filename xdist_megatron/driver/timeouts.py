"""How long a test may run on a gang: one answer for the dispatch, the `gang` fixture and cleanup.

pytest-timeout's own timeout wins where it set one for the item (its hook hands it to us), then a
`@pytest.mark.timeout(s)` marker, then `--megatron-timeout` / ini `megatron_timeout`.
"""

from __future__ import annotations

import math

import pytest

from ..protocol import TIMEOUT

DEFAULT_TIMEOUT = 300.0


def default_timeout(config: pytest.Config) -> float:
    """--megatron-timeout, else ini megatron_timeout; 0 means none, as in pytest-timeout."""
    value = config.getoption("megatron_timeout")
    text = value if value is not None else config.getini("megatron_timeout")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if seconds < 0:
        raise pytest.UsageError(
            f"--megatron-timeout / megatron_timeout must be seconds >= 0, got {text!r}"
        )
    return seconds or math.inf


def timeout_of(item: pytest.Item) -> float:
    """Seconds the test may run on its gang."""
    timeout = item.stash.get(TIMEOUT, None) or _marker_timeout(item)
    return timeout or default_timeout(item.config)


def _marker_timeout(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return None
    value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    return float(value) if value else None
