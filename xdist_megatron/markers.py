"""The `world_size` marker: validation, one item per size, and each item's resolved size; and
`exclusive_devices`, which keeps a test's devices to its gang alone while it runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

MARKER = "world_size"
PARAM = "_megatron_world_size"
ALL = "all"
MARKER_HELP = (
    "world_size(*sizes): run the test body on every rank of a gang of that many processes; "
    "several sizes make one test per size (ids ws1, ws2...); 'all' means every device of the run."
)

EXCLUSIVE_MARKER = "exclusive_devices"
EXCLUSIVE_HELP = (
    "exclusive_devices: the test's gang holds its devices alone while it runs (every slot of "
    "--megatron-gangs-per-device): for memory-hungry or timing-sensitive tests."
)


def is_exclusive(item: pytest.Item) -> bool:
    """Whether the test's gang must hold its devices alone (`exclusive_devices`)."""
    return item.get_closest_marker(EXCLUSIVE_MARKER) is not None


class MarkerError(ValueError):
    """A malformed world_size marker."""


def declared_sizes(marker: Any, test_name: str) -> list[int | str]:
    """The sizes a marker asks for, validated: positive ints or "all", each once."""
    sizes = list(marker.args)
    if marker.kwargs:
        given = ", ".join(f"{k}={v!r}" for k, v in marker.kwargs.items())
        raise MarkerError(
            f"{test_name}: @pytest.mark.world_size takes sizes as positional arguments, "
            f"e.g. world_size(2) or world_size(1, 2), not world_size({given})"
        )
    if not sizes:
        raise MarkerError(f"{test_name}: @pytest.mark.world_size needs at least one size")
    repeated = sorted({repr(world_size) for world_size in sizes if sizes.count(world_size) > 1})
    if repeated:
        raise MarkerError(
            f"{test_name}: @pytest.mark.world_size repeats {', '.join(repeated)}: "
            "each size makes one test"
        )
    for world_size in sizes:
        valid = world_size == ALL or (type(world_size) is int and world_size > 0)
        if not valid:
            raise MarkerError(
                f"{test_name}: @pytest.mark.world_size expects positive ints or 'all', "
                f"got {world_size!r}"
            )
    return sizes


def resolve(world_size: int | str, device_count: Callable[[], int]) -> int:
    return device_count() if world_size == ALL else int(world_size)


def parametrize_sizes(metafunc: pytest.Metafunc, device_count: Callable[[], int]) -> list[int]:
    """The test's sizes, resolved; several make one item per size with the ids ws1, ws2..."""
    marker = metafunc.definition.get_closest_marker(MARKER)
    sizes = declared_sizes(marker, metafunc.definition.nodeid)
    resolved = list(dict.fromkeys(resolve(s, device_count) for s in sizes))
    if len(sizes) > 1:
        one_item_per_size(metafunc, resolved)
    return resolved


def one_item_per_size(metafunc: pytest.Metafunc, sizes: list[int]) -> None:
    """Parametrize the test by world size, with the ids ws1, ws2..."""
    metafunc.fixturenames.append(PARAM)
    metafunc.parametrize(PARAM, sizes, ids=[f"ws{n}" for n in sizes])


def item_world_size(
    item: pytest.Item, device_count: Callable[[], int], default: int | None
) -> int | None:
    """The gang size an item runs on: its marker's, else `default` (--megatron-world-size),
    else None (the test runs in the driver). `device_count` is asked only for a marker: it
    imports torch, which an unmarked suite may never need."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and PARAM in callspec.params:
        return callspec.params[PARAM]
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return default
    return resolve(declared_sizes(marker, item.nodeid)[0], device_count)


def default_world_size(config: pytest.Config) -> int | None:
    """--megatron-world-size / megatron_world_size: a positive int, or unset."""
    value = config.getoption("megatron_world_size") or config.getini("megatron_world_size")
    if value in (None, ""):
        return None
    try:
        world_size = int(value)
    except ValueError:
        world_size = 0
    if world_size < 1:
        raise pytest.UsageError(f"--megatron-world-size must be a positive int, got {value!r}")
    return world_size
