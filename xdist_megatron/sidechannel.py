"""The side channel between xdist workers and the controller, through files in a session folder.

xdist hands the scheduler node ids only; the workers write each item's module, world size and
class after collection, and the controller writes which world sizes are still to come so that a
worker can shut down gangs it will not use again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .protocol import write_json

ITEMS_SUFFIX = ".items.json"
PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class ItemInfo:
    """What the scheduler needs to know of one collected test."""

    module: str
    world_size: int | None  # None for an unmarked test
    cls: str | None
    exclusive: bool = False  # `exclusive_devices`: its gang holds its devices alone
    whole: str | None = None  # a group whose tests run on one worker, in order (a harness's
    # class that keeps one pool of workers and stops at its first failure)


def write_items(folder: str, worker: str, items: dict[str, ItemInfo]) -> None:
    data = {
        nodeid: [i.module, i.world_size, i.cls, i.exclusive, i.whole] for nodeid, i in items.items()
    }
    write_json(Path(folder) / f"{worker}{ITEMS_SUFFIX}", data)


def read_items(folder: str) -> dict[str, ItemInfo]:
    """Every worker's item facts merged (all workers collect the same tests)."""
    items: dict[str, ItemInfo] = {}
    for path in sorted(Path(folder).glob(f"*{ITEMS_SUFFIX}")):
        for nodeid, fields in json.loads(path.read_text()).items():
            items.setdefault(nodeid, ItemInfo(*fields))
    return items


def plan(unassigned: set[int], pending: dict[int, set[int]]) -> dict:
    """The world sizes still to come (0: unmarked): unassigned ones, and each worker's pending."""
    return {
        "unassigned": sorted(unassigned),
        "pending": {str(w): sorted(s) for w, s in pending.items()},
    }


def write_plan(folder: str, unassigned: set[int], pending: dict[int, set[int]]) -> None:
    write_json(Path(folder) / PLAN_FILE, plan(unassigned, pending))


def sizes_in_plan(data: dict, worker: int) -> set[int]:
    """World sizes worker `worker` may still run under the plan `data`."""
    return set(data["unassigned"]) | set(data["pending"].get(str(worker), []))


def sizes_still_needed(folder: str, worker: int) -> set[int] | None:
    """World sizes this worker may still run (None when no plan has been written)."""
    try:
        data = json.loads((Path(folder) / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return sizes_in_plan(data, worker)
