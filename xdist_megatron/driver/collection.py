"""Collection in a driver and on a rank (plugin.py calls it with the role's runtime): check the
markers (a mistake is a collection error naming the test, before any gang starts), make one item
per world size, and give each item its world size, its layout, or the skip that says why it
cannot run here."""

from __future__ import annotations

from typing import Protocol

import pytest

from .. import layouts, markers
from ..ci import selection
from ..protocol import HARNESS, ITEMS, LAYOUT, WORLD_SIZE
from ..roles import Role, role_of


class Sizing(Protocol):
    """What collection asks of the role's runtime (a driver's, or a rank's)."""

    default_world_size: int | None

    @property
    def device_count(self) -> int: ...

    def unfit(self, world_size: int) -> str | None: ...

    def assigned(self, items: list[pytest.Item]) -> None: ...


def parametrize(metafunc: pytest.Metafunc, runtime: Sizing) -> None:
    """One item per world size of the test's marker (or the run's default world size)."""
    definition = metafunc.definition
    size_marker = definition.get_closest_marker(markers.MARKER)
    layout_marker = definition.get_closest_marker(layouts.MARKER)
    if size_marker is None and layout_marker is None:
        return
    name = definition.nodeid
    try:
        for marker in definition.iter_markers(markers.MARKER):  # a class's, under the method's
            markers.declared_sizes(marker, name)
        if size_marker is not None:
            world_sizes = markers.parametrize_sizes(metafunc, lambda: runtime.device_count)
        elif runtime.default_world_size is not None:
            world_sizes = [runtime.default_world_size]
        else:
            raise layouts.LayoutError(
                f"{name}: @pytest.mark.megatron needs a world size: add "
                "@pytest.mark.world_size(N), or give the run --megatron-world-size N"
            )
        if layout_marker is not None:
            layout = layouts.layout_of(layout_marker, name)
            for world_size in world_sizes:
                layouts.check_fits(layout, world_size, name)
    except (markers.MarkerError, layouts.LayoutError) as exc:
        raise pytest.Collector.CollectError(str(exc)) from None


def assign(config: pytest.Config, items: list[pytest.Item], runtime: Sizing) -> None:
    """Stash each item's world size and layout, skip what cannot run here and select this CI
    job's tests (on a gang's rank its driver chose them: the rank collected one module)."""
    config.stash[ITEMS] = items
    for item in items:
        if HARNESS in item.stash:  # its harness gave it its world size
            continue
        world_size = markers.item_world_size(
            item, lambda: runtime.device_count, runtime.default_world_size
        )
        if world_size is None:
            continue
        item.stash[WORLD_SIZE] = world_size
        layout_marker = item.get_closest_marker(layouts.MARKER)
        if layout_marker is not None:
            item.stash[LAYOUT] = layouts.layout_of(layout_marker, item.nodeid)
        reason = runtime.unfit(world_size)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
    if role_of(config) is not Role.GANG_RANK:
        selection.select(config, items)
    runtime.assigned(items)
