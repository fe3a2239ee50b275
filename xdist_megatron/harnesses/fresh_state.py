"""On a rank: module state as a freshly spawned child would import it.

A spawned child imports the test module (and the harness's) afresh; a rank imported them once
and keeps what earlier tests rebound there (a barrier counter such as
`distributed_test.Barrier.barrier_id`, a module-level flag). Before a child's part runs, the
plain values (numbers, strings, tuples...) of those modules' attributes and of their classes'
are put back to what this rank first saw. Containers changed in place are not, as in a
harness's own persistent worker pools, except in modules named as registries of the library's
process state (DeepSpeed's groups by name): those are refilled in place with what they held.
"""

from __future__ import annotations

import copy
import types
from typing import Any

PLAIN_TYPES = (int, float, str, bytes, bool, type(None), tuple, frozenset)
CONTAINER_TYPES = (dict, list, set)

_first_seen: dict[str, dict[str, Any]] = {}  # module or class -> its plain attributes
_first_held: dict[str, dict[str, Any]] = {}  # registry module -> copies of its containers
_MISSING = object()


def start_fresh(
    modules: list[types.ModuleType], registries: list[types.ModuleType] | None = None
) -> None:
    """Put back the plain attributes of `modules` and of the classes they define, and the
    module-level containers of `registries` (taken as in `modules` too)."""
    registries = registries or []
    for module in dict.fromkeys([*modules, *registries]):  # a registry may be among `modules`
        _restore(module.__name__, module)
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == module.__name__:
                _restore(f"{module.__name__}:{value.__qualname__}", value)
    for module in registries:
        _refill(module)


def _restore(key: str, owner: Any) -> None:
    first = _first_seen.get(key)
    if first is None:
        _first_seen[key] = {
            name: value for name, value in vars(owner).items() if isinstance(value, PLAIN_TYPES)
        }
        return
    current = vars(owner)
    for name, value in first.items():
        if current.get(name, _MISSING) is not value:
            setattr(owner, name, value)


def _refill(module: types.ModuleType) -> None:
    """The containers `module` holds, emptied and given back their first contents in place
    (other modules hold the same objects)."""
    first = _first_held.get(module.__name__)
    if first is None:
        _first_held[module.__name__] = {
            name: copy.copy(value)
            for name, value in vars(module).items()
            if type(value) in CONTAINER_TYPES and not name.startswith("__")  # __builtins__
        }
        return
    current = vars(module)
    for name, contents in first.items():
        held = current.get(name)
        if type(held) is not type(contents):
            setattr(module, name, copy.copy(contents))
        else:
            held.clear()
            if isinstance(held, list):
                held.extend(contents)
            else:
                held.update(contents)
