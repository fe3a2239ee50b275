"""The gang of one world size over a driver's session, read top to bottom: started on first
use, checked for ranks lost between tests, reset at a module boundary (or replaced, under module
scope), retired by a failure and started again at the next use. Each start and retirement goes
to the run report's log. The pool (pool.py) keeps which slots exist and the devices they hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..protocol import FAILED, GangEvent, RankResult, ResetJob, describe_exit
from .gang import Gang, GangError, retire_cause
from .zygote_client import ForkRefused

RESET_TIMEOUT = 120.0
SESSION_SCOPE, MODULE_SCOPE = "session", "module"


class GangLog:
    """The starts and retirements of a driver's gangs, for the run report."""

    def __init__(self) -> None:
        self.events: list[GangEvent] = []
        self.names: dict[int, str] = {}  # world size -> the current gang's name, "ws2#1"
        self._retired: set[str] = set()

    def started(self, world_size: int) -> None:
        cause = "replaced a retired one" if world_size in self.names else "first use"
        count = sum(e.kind == "start" and e.world_size == world_size for e in self.events) + 1
        self.names[world_size] = name = f"ws{world_size}#{count}"
        self.events.append(GangEvent(time.time(), "start", world_size, name, cause))

    def retired(self, world_size: int, cause: str) -> None:
        """The current gang of `world_size` retired (logged once, under the first cause)."""
        name = self.names.get(world_size)
        if name is not None and name not in self._retired:
            self._retired.add(name)
            self.events.append(GangEvent(time.time(), "retire", world_size, name, cause))


class GangSlot:
    """The gang of `world_size` ranks, started by `new_gang` whenever the slot needs one."""

    def __init__(
        self,
        world_size: int,
        new_gang: Callable[[], Gang],
        scope: str,
        log: GangLog,
        notes: list[str],
        exit_code: Callable[[int], int | None],
    ) -> None:
        """`exit_code(pid)`: how a rank that died between tests ended, as its zygote saw it;
        `notes`: the terminal summary's."""
        self.world_size = world_size
        self.gang: Gang | None = None
        self._new_gang = new_gang
        self._scope = scope
        self._log = log
        self._notes = notes
        self._exit_code = exit_code

    # -- start ---------------------------------------------------------------------------------

    def ready(self) -> Gang:
        """A live gang: the one there, else a new one (the last may have retired in a test of
        the `gang` fixture, which the slot did not see)."""
        if self.gang is not None and not self.gang.alive:
            self._log.retired(self.world_size, "a failure in a test")
        if self.gang is None or not self.gang.alive:
            self.gang = self._start()
            self._log.started(self.world_size)
        return self.gang

    def _start(self) -> Gang:
        """A started gang; a fork the zygote refused once (another worker's preload spoilt the
        shared zygote, which the keeper then replaces) is tried again."""
        try:
            return self._new_gang()
        except ForkRefused:
            try:
                return self._new_gang()
            except ForkRefused as exc:
                raise GangError(str(exc)) from None

    # -- use -----------------------------------------------------------------------------------

    def for_test(self, module: str, timeout: float, nodeid: str | None = None) -> Gang:
        """The live gang for a test of `module` (`nodeid`, where known): healthy, and reset to
        its start-up state if the module is new to it."""
        self._drop_if_ranks_lost()
        gang = self.gang
        if gang is not None and gang.alive and gang.last_module not in (None, module):
            self._cross_module_boundary(gang, module, nodeid)
        gang = self.ready()
        gang.last_module = module
        gang.timeout = timeout
        return gang

    def job_done(self, results: list[RankResult]) -> None:
        """After a job: a gang that the job left dead is retired for what its ranks said."""
        if self.gang is not None and not self.gang.alive:
            self._log.retired(self.world_size, retire_cause(results))

    # -- health --------------------------------------------------------------------------------

    def _drop_if_ranks_lost(self) -> None:
        """A gang whose rank died while it was idle is retired (`ready` starts another)."""
        gang = self.gang
        lost = gang.lost_ranks() if gang is not None and gang.alive else []
        if gang is None or not lost:
            return
        why = f"rank {lost[0]} {describe_exit(self._exit_code(gang.pids[lost[0]]))} between tests"
        self._notes.append(f"gang of {self.world_size}: {why}; replaced it")
        gang.retire()
        self._log.retired(self.world_size, "a rank died between tests")

    # -- module boundary -----------------------------------------------------------------------

    def _cross_module_boundary(self, gang: Gang, module: str, nodeid: str | None) -> None:
        """Reset `gang` for `module`, or end it (module scope; a reset that failed retired it)
        for `ready` to replace."""
        if self._scope == MODULE_SCOPE:
            self.retire("module scope")
            return
        results = gang.execute(ResetJob(nodeid), RESET_TIMEOUT)
        failed = [r for r in results if r.outcome == FAILED]
        if failed:
            self._notes.append(
                f"gang of {self.world_size}: reset before {module} failed on rank "
                f"{failed[0].rank} ({failed[0].message}); replaced it with a fresh gang"
            )
            self._log.retired(self.world_size, "reset failed")

    # -- retirement ----------------------------------------------------------------------------

    def retire(self, cause: str) -> None:
        """Shut the gang down cleanly, for `cause` (the slot starts another at its next use)."""
        gang, self.gang = self.gang, None
        if gang is None:
            return
        if gang.alive:
            self._log.retired(self.world_size, cause)
        gang.close()
