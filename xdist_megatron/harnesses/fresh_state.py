"""On a rank: module state as a freshly spawned child would import it.

A spawned child imports the test module (and the harness's) afresh; a rank imported them once
and keeps what earlier tests rebound there (a barrier counter such as
`distributed_test.Barrier.barrier_id`, a module-level flag). Before a child's part runs, the
plain values (numbers, strings, tuples...) of those modules' attributes and of their classes'
are put back to what this rank first saw. Containers changed in place are not: as in a
harness's own persistent worker pools.
"""

from __future__ import annotations

import types
from typing import Any

PLAIN_TYPES = (int, float, str, bytes, bool, type(None), tuple, frozenset)

_first_seen: dict[str, dict[str, Any]] = {}  # module or class -> its plain attributes
_MISSING = object()


def start_fresh(modules: list[types.ModuleType]) -> None:
    """Put back the plain attributes of `modules` and of the classes they define."""
    for module in modules:
        _restore(module.__name__, module)
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == module.__name__:
                _restore(f"{module.__name__}:{value.__qualname__}", value)


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
