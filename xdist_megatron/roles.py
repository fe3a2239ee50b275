"""Which process this is, decided in one place: no other module asks the environment.

- a gang's rank: the zygote forked it (its pid in `ZYGOTE_VAR`) and gave it a `RANK`;
- a torchrun rank: torchrun's `RANK`, `WORLD_SIZE` and `LOCAL_RANK`, and not ours;
- an xdist worker: xdist gives its config a `workerinput` (before the config exists, only its
  `PYTEST_XDIST_WORKER` says so, which a pytest started inside a worker inherits);
- else the process that owns the session: the serial driver, or xdist's controller once xdist
  has decided to start workers (its `pytest_cmdline_main`, before any `pytest_configure`).

`started_as` is known from the first hook on; `decide` settles the session owner's role at
`pytest_cmdline_main` and keeps it on the config, where `role_of` finds it.
"""

from __future__ import annotations

import enum
import os

import pytest

from .protocol import TORCHRUN_VARS, XDIST_WORKER_VAR, ZYGOTE_VAR


class Role(enum.Enum):
    GANG_RANK = "a gang's rank"
    TORCHRUN_RANK = "a torchrun rank"
    WORKER = "an xdist worker"
    SESSION_OWNER = "the serial driver or the xdist controller"  # until `decide`
    SERIAL = "the serial driver"
    CONTROLLER = "the xdist controller"

    @property
    def is_rank(self) -> bool:
        """Runs its tests in this process (on a gang, or as torchrun started it)."""
        return self in (Role.GANG_RANK, Role.TORCHRUN_RANK)

    @property
    def owns_session(self) -> bool:
        """Starts what the host's processes share: the session folder, the shared zygote."""
        return self in (Role.SESSION_OWNER, Role.SERIAL, Role.CONTROLLER)


_ROLE = pytest.StashKey[Role]()


def started_as() -> Role:
    """This process's role as its start made it, before its config exists: the session owner
    not yet told apart, a worker by its environment alone."""
    if ZYGOTE_VAR in os.environ and "RANK" in os.environ:
        return Role.GANG_RANK
    if all(name in os.environ for name in TORCHRUN_VARS) and ZYGOTE_VAR not in os.environ:
        return Role.TORCHRUN_RANK
    if XDIST_WORKER_VAR in os.environ:
        return Role.WORKER
    return Role.SESSION_OWNER


def decide(config: pytest.Config) -> Role:
    """At `pytest_cmdline_main`, once xdist has decided whether to start workers (`tx`, which
    `-n` fills; its hook runs first): this process's role, kept on its config."""
    config.stash[_ROLE] = role = _settled(config)
    return role


def role_of(config: pytest.Config) -> Role:
    """The role `decide` kept (a config pytest made without its main: settled now)."""
    return config.stash.get(_ROLE, None) or _settled(config)


def _settled(config: pytest.Config) -> Role:
    """A rank as started; a worker by its config; the session owner is the controller where
    xdist starts workers, else the serial driver."""
    role = started_as()
    if role.is_rank:
        return role
    if hasattr(config, "workerinput"):
        return Role.WORKER
    return Role.CONTROLLER if config.getoption("tx", None) else Role.SERIAL
