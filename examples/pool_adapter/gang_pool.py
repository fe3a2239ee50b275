"""The worker pool's interface on a gang (see conftest.py): in a module of its own, so that the
ranks find `_on_rank` by its module's name, which no other conftest shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import xdist_megatron

Teardown = Callable[[int, int], None]


class GangPool:
    """The worker pool's interface on the test's gang."""

    def __init__(self, gang: Any, teardown_fn: Teardown | None = None) -> None:
        self._gang = gang
        self._teardown = teardown_fn  # the pool's per-run hook; the plugin cleans after the test

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """`fn(rank, world_size, *args, **kwargs)` on every rank; a rank's error fails the test."""
        self._gang.run(_on_rank, fn, self._teardown, args, kwargs)

    def shutdown(self) -> None:
        """Nothing to do: the plugin owns the gang."""


def _on_rank(fn: Callable[..., Any], teardown: Teardown | None, args: tuple, kwargs: dict) -> None:
    info = xdist_megatron.rank_info()
    try:
        fn(info.rank, info.world_size, *args, **kwargs)
    finally:
        if teardown is not None:
            teardown(info.rank, info.world_size)
