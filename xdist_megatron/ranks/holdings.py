"""What class, module and session fixtures set up on a rank, kept until their scope ends.

The per-test cleanup drops the process groups and Megatron state a test left behind, but a
`setup_class` that initialised the model-parallel state, or a module fixture that returns a group,
must keep them for the next tests of its scope, as under torchrun. Each wider fixture's setup is
watched: the groups it created and whether it set Megatron up are its holding, released right
after the fixture's own teardown when pytest ends its scope.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import pytest

FUNCTION_SCOPE = "function"
SESSION_SCOPES = ("session", "package")


@dataclass(eq=False)
class Holding:
    """What one wider-scoped fixture set up."""

    groups: list[object] = field(default_factory=list)
    megatron: bool = False


class ScopeHoldings:
    """pytest plugin on a rank: records each wider fixture's holding while it is set up."""

    def __init__(self, on_session_fixture: Callable[[Any, Any], None]) -> None:
        self.live: list[Holding] = []
        self._on_session_fixture = on_session_fixture

    @property
    def groups(self) -> list[object]:
        return [group for holding in self.live for group in holding.groups]

    @property
    def megatron(self) -> bool:
        return any(holding.megatron for holding in self.live)

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest
    ) -> Generator[None, object, object]:
        if fixturedef.scope == FUNCTION_SCOPE:
            return (yield)
        from . import isolation

        before = {id(group) for group in isolation.process_groups()}
        megatron_before = isolation.megatron_fingerprint()
        wide = fixturedef.scope in SESSION_SCOPES
        settings_before = isolation.snapshot() if wide else None
        holding = Holding()
        # Registered before the fixture's own teardown, so it runs after it.
        fixturedef.addfinalizer(functools.partial(self._release, holding))
        try:
            return (yield)
        finally:
            holding.groups = [g for g in isolation.process_groups() if id(g) not in before]
            holding.megatron = isolation.megatron_fingerprint() != megatron_before
            self.live.append(holding)
            if wide:
                self._on_session_fixture(settings_before, isolation.snapshot())

    def _release(self, holding: Holding) -> None:
        from . import isolation

        if holding in self.live:
            self.live.remove(holding)
        isolation.release(holding.groups, holding.megatron and not self.megatron)
