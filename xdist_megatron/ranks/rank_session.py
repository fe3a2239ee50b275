"""A rank's own pytest session, so a marked test's whole protocol runs on the rank.

As in a `torchrun -m pytest` rank: the session is built from the driver's arguments, ini and
plugins (conftest files are imported here), a test's module is collected here on its first test,
and pytest's own runner runs setup, call and teardown with its fixtures and hooks. Fixture scopes
live as long as the rank: the driver names the next test this gang will run, and pytest's
`nextitem` logic keeps what that test shares. Reports go back serialised, as xdist's do.

Built on the rank's first test, never in the zygote: conftest files are test code.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _pytest.runner import collect_one_node

from ..protocol import SessionArgs

# Options that make sense once per run, in the driver: a rank must not distribute, write the
# driver's junit or report files, stop the session, debug on a terminal, or read the cache to
# reorder and deselect, nor select again by -k, -m or --deselect (the driver chose the tests).
_DRIVER_ONLY_OPTIONS: dict[str, Any] = {
    "numprocesses": None,
    "maxprocesses": None,
    "dist": "no",
    "tx": [],
    "looponfail": False,
    "usepdb": False,
    "trace": False,
    "xmlpath": None,
    "report_log": None,
    "htmlpath": None,
    "maxfail": 0,
    "exitfirst": False,
    "lf": False,
    "failedfirst": False,
    "newfirst": False,
    "stepwise": False,
    "stepwise_skip": False,
    "cacheclear": False,
    "collectonly": False,
    "keyword": "",
    "markexpr": "",
    "deselect": [],
}


class CollectionFailed(Exception):
    """The rank could not collect the collector that leads to a test."""


@dataclass(frozen=True)
class _NextOnGang:
    """Stands in for the next test this gang runs when its module is not collected here yet:
    pytest's teardown compares only the collector chain, which is known from the node id."""

    chain: list[Any]

    def listchain(self) -> list[Any]:
        return self.chain


class RankSession:
    """The rank's pytest config and session, with the items it collected so far."""

    def __init__(self, args: SessionArgs, rank: int, reports: Callable[[Any], None]) -> None:
        from _pytest.config import _prepareconfig
        from _pytest.main import Session

        os.chdir(args.invocation_dir)
        sys.path[:] = args.sys_path
        cache = os.path.join(args.basetemp, f"cache-rank{rank}-{os.getpid()}")
        rank_args = [a for a in args.args if not a.startswith("--debug")]  # the driver's log
        rank_args += ["-o", f"cache_dir={cache}", *args.extra]
        with _quiet_stdout():
            config = _prepareconfig(rank_args, None)
            for name, value in _DRIVER_ONLY_OPTIONS.items():
                if hasattr(config.option, name):
                    setattr(config.option, name, value)
            config.option.basetemp = os.path.join(args.basetemp, f"rank{rank}-{os.getpid()}")
            self._sender = _ReportSender(config, reports)
            config.pluginmanager.register(self._sender, "xdist-megatron-sender")
            config._do_configure()
            self.config = config
            self.session = Session.from_config(config)
            config.hook.pytest_sessionstart(session=self.session)
        self._items: dict[str, pytest.Item] = {}
        self._collected: set[str] = set()
        self._roots: list[Any] | None = None  # what the run's arguments name, uncollected
        self._children: dict[Any, list[Any]] = {}

    def run(self, nodeid: str, module_path: str, next_nodeid: str | None) -> None:
        """Run one test's protocol (its reports go to the driver as they are made)."""
        item = self._item(nodeid, module_path)
        if item is None:
            errors = "\n".join(self._sender.collect_errors)
            raise CollectionFailed(f"{nodeid} was not collected on this rank\n{errors}".strip())
        # Scopes the last test kept for a successor that did not come: pytest raises their
        # finalizers' errors here, with no test left to report them on.
        self.session._setupstate.teardown_exact(item)
        self.session.shouldfail = self.session.shouldstop = False
        item.ihook.pytest_runtest_protocol(item=item, nextitem=self._next(item, next_nodeid))

    def take_warnings(self) -> list[dict]:
        """The warnings the tests raised since the last call."""
        taken, self._sender.warnings = self._sender.warnings, []
        return taken

    def teardown_until(self, next_nodeid: str | None) -> None:
        """Module boundary: end the scopes that the next test (None: unknown) does not share,
        the session's (and its package's) staying."""
        stack = list(self.session._setupstate.stack)
        self.session._setupstate.teardown_exact(_NextOnGang(self._shared(stack, next_nodeid)))

    def finish(self) -> None:
        """End of the gang: session-scoped fixtures end, then the session itself."""
        try:
            self.session._setupstate.teardown_exact(None)
        finally:
            self.config.hook.pytest_sessionfinish(session=self.session, exitstatus=0)
            self.config._ensure_unconfigure()

    def _item(self, nodeid: str, module_path: str) -> pytest.Item | None:
        if nodeid not in self._items and module_path not in self._collected:
            self._collected.add(module_path)
            with _quiet_stdout():
                items = self._collect_module(Path(module_path))
            self._items.update((item.nodeid, item) for item in items)
            # The module and what it imported live as long as the rank: keep them out of the
            # collections that the cleanup after each test runs.
            gc.collect()
            gc.freeze()
        return self._items.get(nodeid)

    def _collect_module(self, path: Path) -> list[pytest.Item]:
        """The items of one test module, collected through the same collector nodes every time
        (pytest keys a conftest's fixtures by its directory's node): the run's arguments once,
        then only the directories that lead to the module."""
        if self._roots is None:
            self._roots = self._collect_arguments()
        items: list[pytest.Item] = []
        for root in self._roots:
            node = self._descend(root, path)
            if node is not None:
                items += self.session.genitems(node)
        self.config.hook.pytest_collection_modifyitems(
            session=self.session, config=self.config, items=items
        )
        return items

    def _collect_arguments(self) -> list[Any]:
        """The nodes the run's arguments name, not collected further. pytest >= 9.1 parses a
        conftest's fixtures when its directory is collected and, at the end of a collection,
        forgets the conftests whose directories were not: those are collected later here."""
        keeper = _PendingConftests()
        self.config.pluginmanager.register(keeper)
        try:
            roots = list(self.session.perform_collect(None, genitems=False))
        finally:
            self.config.pluginmanager.unregister(keeper)
        pending = getattr(self.session._fixturemanager, "_pending_conftests", None)
        if pending is not None:
            pending.update(keeper.saved)
        return roots

    def _descend(self, node: Any, path: Path) -> Any:
        """The collector of `path` under `node` (or `node` itself when an argument named a test
        there), or None when `path` is not under it."""
        while isinstance(node, pytest.Collector) and node.path != path:
            if node.path not in path.parents:
                return None
            if node not in self._children:
                report = collect_one_node(node)
                if not report.passed:
                    raise CollectionFailed(f"collecting {node.nodeid}:\n{report.longrepr}")
                self._children[node] = list(report.result)
            node = next(
                (c for c in self._children[node] if c.path == path or c.path in path.parents),
                None,
            )
        if isinstance(node, pytest.Item) and node.path != path:
            return None
        return node

    def _next(self, item: pytest.Item, next_nodeid: str | None) -> Any:
        """The next test on this gang as pytest's teardown sees it."""
        known = self._items.get(next_nodeid) if next_nodeid is not None else None
        return known or _NextOnGang(self._shared(item.listchain(), next_nodeid))

    def _shared(self, chain: list[Any], next_nodeid: str | None) -> list[Any]:
        """The nodes of `chain` the test `next_nodeid` descends from too (None: the session's)."""
        if next_nodeid is None:
            return [self.session]
        return [
            n
            for n in chain
            if n.nodeid in ("", ".") or next_nodeid.startswith((n.nodeid + "::", n.nodeid + "/"))
        ]


_DEVNULL = open(os.devnull, "w")  # noqa: SIM115 - the rank's terminal, for its whole life


@contextlib.contextmanager
def _quiet_stdout() -> Any:
    """pytest's terminal reporter writes to the sys.stdout it finds at configure time: a rank's
    terminal output has no reader, the driver reports for it."""
    saved, sys.stdout = sys.stdout, _DEVNULL
    try:
        yield
    finally:
        sys.stdout = saved


class _PendingConftests:
    """Keeps the conftests pytest is about to forget at the end of a collection."""

    def __init__(self) -> None:
        self.saved: dict[Any, Any] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.saved = dict(getattr(session._fixturemanager, "_pending_conftests", {}))


class _ReportSender:
    """Sends each report of the rank's runner to the driver as soon as it is made, and keeps the
    warnings its tests raised for the driver's warnings summary."""

    def __init__(self, config: pytest.Config, send: Callable[[Any], None]) -> None:
        self._config = config
        self._send = send
        self.warnings: list[dict] = []
        self.collect_errors: list[str] = []

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors.append(f"{report.nodeid}:\n{report.longrepr}")

    def pytest_warning_recorded(self, warning_message: Any, when: str, nodeid: str) -> None:
        if when != "runtest":
            return
        category = warning_message.category
        self.warnings.append(
            {
                "category": f"{category.__module__}:{category.__qualname__}",
                "message": str(warning_message.message),
                "filename": warning_message.filename,
                "lineno": warning_message.lineno,
            }
        )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        hook = self._config.hook
        self._send(hook.pytest_report_to_serializable(config=self._config, report=report))
