"""Starts the zygote while the driver is still importing the suite (its conftest files, then its
test modules), and has it import the same library packages as the driver imports them (which
are libraries: `preload.py`).

Without it the zygote's imports begin after collection, and the first gang waits for all of
them: torch and megatron.core take ~15 s on an H200 host, as long as the driver took to import
them. The zygote starts when the driver imports torch (a suite that never does needs no gangs)
and follows with each library package the driver has imported since, polled a few times a
second; the package list collection found is added afterwards, as before.

A pytest plugin module of every run (plugin.py lists it), so that it starts after pytest-cov
started measuring (its hook is tryfirst) and a zygote started at once measures its preloads too;
it starts only in a run known to use the plugin (`early_cache.uses_plugin`), else when
collection finds the first test on a gang (`start`). Light to import: a run that uses none of
the plugin imports it too.
"""

from __future__ import annotations

import sys
import tempfile
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from ..ci import early_cache
from ..protocol import DIST_MODE
from ..roles import started_as
from . import bytecode
from .preload import Preloadable, gpus_likely, preloadable_of, with_base

if TYPE_CHECKING:
    from .zygote_client import ZygoteClient

POLL_SECONDS = 0.05
TRIGGER = "torch"


def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Before the conftest files import the suite's packages, in a run known to use the plugin."""
    if early_cache.uses_plugin(early_config):
        start(early_config)


def start(config: pytest.Config) -> None:
    """Share bytecode first where it is off, so that the zygote compiles nothing the driver has
    compiled (`bytecode`); then follow the imports, in the serial driver or the controller."""
    bytecode.share(config)
    follower = follow_imports(config)
    if follower is not None:
        config.stash[FOLLOWER] = follower


def follow_imports(config: pytest.Config) -> ImportFollower | None:
    """A follower for the serial driver, or the xdist controller's shared zygote; none in ranks,
    xdist workers (they join the controller's), other xdist modes and --collect-only."""
    known = config.known_args_namespace
    if not started_as().owns_session:
        return None
    controller = bool(getattr(known, "numprocesses", None) or getattr(known, "tx", None))
    if known.collectonly or (controller and getattr(known, "dist", None) != DIST_MODE):
        return None
    from . import zygote_client  # here: every run imports this module, few follow

    session_dir = tempfile.mkdtemp(prefix="xdist-megatron-session-")
    log = zygote_client.host_zygote_log(session_dir, known.capture)
    address = zygote_client.shared_address() if controller else None
    cuda = gpus_likely(known.megatron_devices)

    def spawn(modules: list[str]) -> ZygoteClient:
        return zygote_client.spawn(with_base(modules), log, address, cuda)

    return ImportFollower(
        spawn, preloadable_of(config), config.getini("megatron_preload"), session_dir
    )


class ImportFollower:
    """A thread that starts a zygote once `TRIGGER` is imported here and sends it the
    preloadable packages imported since; `finish` stops it and hands the zygote over."""

    def __init__(
        self,
        start: Callable[[list[str]], ZygoteClient],
        preloadable: Preloadable,
        configured: list[str],
        session_dir: str,
    ) -> None:
        """`start(modules)` spawns the zygote; `preloadable` says which modules a top-level
        name stands for; `configured` preloads start the zygote at once. `session_dir` holds
        its log; the session takes it over."""
        self._start = start
        self._preloadable = preloadable
        self._wanted = list(configured)  # names to send with the next poll (under the lock)
        self.session_dir = session_dir
        self._sent: set[str] = set()
        self._seen: set[str] = set()  # the names in sys.modules looked at
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._follow, name="xdist-megatron-imports", daemon=True
        )  # daemon: a session that ends before it is configured must still exit; the zygote
        # ends with this process (its connection closes)
        self.zygote: ZygoteClient | None = None
        self.error: BaseException | None = None
        if configured:
            self._send_new()  # configured preloads: the zygote starts now, not at the first poll
        self._thread.start()

    def want(self, modules: list[str]) -> None:
        """Preloads known to be needed (remembered from the last session): sent with the next
        poll, starting the zygote if it has not started."""
        with self._lock:
            self._wanted += modules
            self._send_new_locked()  # now: the caller may expect the zygote to be starting

    def finish(self) -> ZygoteClient | None:
        """Stop following (once collection is done) and return the zygote, if one started."""
        self._stop.set()
        self._thread.join()
        return self.zygote

    def _follow(self) -> None:
        try:
            while True:
                self._send_new()
                if self._stop.wait(POLL_SECONDS):
                    self._send_new()  # what the last poll missed
                    return
        except BaseException as exc:  # noqa: BLE001 - the main thread decides after finish()
            self.error = exc

    def _send_new(self) -> None:
        with self._lock:  # the polling thread and `want`
            self._send_new_locked()

    def _send_new_locked(self) -> None:
        if self.zygote is None and not self._wanted and TRIGGER not in sys.modules:
            return
        found, self._wanted = self._wanted, []
        fresh = [name for name in list(sys.modules) if name not in self._seen]
        self._seen.update(fresh)
        for name in fresh:
            top, _, rest = name.partition(".")
            if not rest or ("." not in rest and _is_namespace(sys.modules.get(top))):
                found += sorted(self._preloadable.modules(name))
        new = [
            name
            for name in dict.fromkeys(found)
            if name not in self._sent and not self._preloadable.initialises_cuda(name)
        ]
        self._sent.update(new)
        if self.zygote is None:
            self.zygote = self._start(new)
        elif new:
            self.zygote.add_preload(new)


def _is_namespace(module: object) -> bool:
    """A namespace package (`megatron`): its children are the packages to preload."""
    return (
        module is not None and hasattr(module, "__path__") and not getattr(module, "__file__", None)
    )


FOLLOWER = pytest.StashKey[ImportFollower]()


def early_zygote(config: pytest.Config, is_cuda: bool, notes: list[str]) -> ZygoteClient | None:
    """Stop the import follower (once) and take the zygote it started, if it can serve devices
    of this kind (one not started for CUDA is closed); a failure to follow becomes a note."""
    zygote = finish_following(config, notes)
    if zygote is not None and is_cuda and not zygote.cuda:
        zygote.close()  # it did not guard its preloads for CUDA: forks could not use GPUs
        return None
    return zygote


def finish_following(config: pytest.Config, notes: list[str]) -> ZygoteClient | None:
    """Stop the import follower, if one runs, and hand over the zygote it started."""
    follower = config.stash.get(FOLLOWER, None)
    if follower is None:
        return None
    zygote = follower.finish()
    del config.stash[FOLLOWER]  # only now: a second Ctrl-C in the join must not lose the zygote
    if follower.error is not None:
        notes.append(f"following the imports to start the zygote early: {follower.error}")
    return zygote


def followed_session_dir(config: pytest.Config) -> str | None:
    """The session folder the import follower made (it holds the early zygote's log)."""
    follower = config.stash.get(FOLLOWER, None)
    return follower.session_dir if follower is not None else None
