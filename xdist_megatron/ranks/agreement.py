"""The ranks of a gang (or of torchrun) meet after a test and learn whether it failed on any of
them, through a store, not a collective: a rank that failed early must not meet a peer's
collective with one of its own. What they then do (keep a layout or build it again) must be the
same on every rank, or their next group creations would not meet."""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def meet(
    store: Any, key: str, world_size: int, failed: bool, timeout: timedelta | None = None
) -> bool:
    """Wait until the `world_size` ranks have all reached `key` (unique per meeting), at most
    `timeout` (default: the store's own); whether any of them `failed`. Each rank says so before
    it arrives, so the last arrival's count is whole."""
    if failed:
        store.add(f"{key}/failed", 1)
    if store.add(key, 1) == world_size:
        store.set(f"{key}/all", "")
    if timeout is None:
        store.wait([f"{key}/all"])
    else:
        store.wait([f"{key}/all"], timeout)
    return store.add(f"{key}/failed", 0) > 0
