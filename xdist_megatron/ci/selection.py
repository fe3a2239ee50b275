"""Which collected tests this CI job runs: `--megatron-world-sizes` (a matrix leg by GPU count)
and `--megatron-shard K/N` (part K of N by device-time). Left-out tests are deselected, not
skipped, as `-k` does.

Under xdist every worker collects and selects: the selection depends only on the collected
tests and the durations, so every worker keeps the same tests and xdist's check that the
workers collected alike holds. Sizes are selected first, then the rest is sharded, so that the
legs of a matrix over GPU count and shard compose.
"""

from __future__ import annotations

from typing import Any

import pytest

from ..protocol import WORLD_SIZE, module_of
from . import durations, sharding


def add_options(group: Any, parser: pytest.Parser) -> None:
    group.addoption(
        "--megatron-shard",
        default=None,
        metavar="K/N",
        help="run part K (1-based) of N parts of the suite, balanced by device-time (world size "
        "x duration); each (module, world size) stays in one part.",
    )
    group.addoption(
        "--megatron-world-sizes",
        default=None,
        metavar="SIZES",
        help="run only tests of these world sizes, e.g. '2,4' (unmarked tests are size 1, or "
        "--megatron-world-size); default: ini megatron_world_sizes, unset: every size.",
    )
    parser.addini("megatron_world_sizes", "default of --megatron-world-sizes", default="")


def shard(config: pytest.Config) -> tuple[int, int] | None:
    text = config.getoption("megatron_shard")
    if text is None:
        return None
    try:
        return sharding.parse_shard(text)
    except ValueError as exc:
        raise pytest.UsageError(f"--megatron-shard: {exc}") from None


def world_sizes(config: pytest.Config) -> set[int] | None:
    text = config.getoption("megatron_world_sizes") or config.getini("megatron_world_sizes")
    if not text:
        return None
    try:
        sizes = {int(part) for part in text.split(",")}
    except ValueError:
        sizes = {0}
    if min(sizes) < 1:
        raise pytest.UsageError(
            f"--megatron-world-sizes / megatron_world_sizes must be positive ints separated by "
            f"commas, e.g. 2,4; got {text!r}"
        )
    return sizes


def check(config: pytest.Config) -> None:
    """A malformed option is a usage error at configure time, naming the option."""
    shard(config)
    world_sizes(config)


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep this job's tests in `items` (sizes resolved); report the others as deselected."""
    sizes = world_sizes(config)
    kept = [i for i in items if sizes is None or (i.stash.get(WORLD_SIZE, None) or 1) in sizes]
    part = shard(config)
    if part is not None:
        kept = _part(config, kept, *part)
    if len(kept) == len(items):
        return
    chosen = set(map(id, kept))
    config.hook.pytest_deselected(items=[i for i in items if id(i) not in chosen])
    items[:] = kept


def _part(config: pytest.Config, items: list[pytest.Item], k: int, n: int) -> list[pytest.Item]:
    known = durations.load(config)
    typical = sharding.typical_duration(known.values())
    entries = [
        sharding.ShardEntry(
            item.nodeid,
            module_of(item.nodeid),
            item.stash.get(WORLD_SIZE, None),
            known.get(item.nodeid, typical),
        )
        for item in items
    ]
    mine = set(sharding.partition(entries, n)[k - 1])
    return [item for item in items if item.nodeid in mine]
