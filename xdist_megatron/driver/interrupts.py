"""Ctrl-C in a driver (the serial pytest process, an xdist controller or worker) ends the run as
pytest ends an interrupted one, wherever it lands: its KeyboardInterrupt summary, naming the line
where the SIGINT landed, exit code 2, and the zygote and ranks killed at once (the role's
runtime's `CLOSE_NOW`), before pytest spends a second formatting the traceback.

Two things lost it in the first seconds, while the conftest files import the suite's libraries
(and the import follower starts the zygote beside them):

- Library code may swallow the KeyboardInterrupt: torch's C extension imports numpy at import
  and drops any error of that import, so a Ctrl-C that landed there went unnoticed and the run
  went on into the tests. A SIGINT handler remembers the interrupt until pytest has handled it;
  the session raises it again when it starts and when collection ends.
- A KeyboardInterrupt out of the initial conftest files ends pytest before its session exists:
  a traceback, death by SIGINT, and nobody to stop the zygote. It is held until the session
  starts, which raises it where pytest reports interrupts and cleans up.

A third lost it later, in an xdist worker: see `Latch.pytest_runtest_protocol`.

pytest's summary names the last entry of the interrupt's traceback, which was this handler's
line (`interrupts.py:50: KeyboardInterrupt`, read as a crash of the plugin). It names where the
SIGINT landed outside the plugin now: the plugin's frames at the end of the traceback are cut
(the handler's; the bytecode hook's, inside any import); an interrupt raised again is raised
with that frame as its only entry below the session's; one during a test on a gang, whose body
runs on the ranks while the driver waits, is raised at the test, where torchrun's ranks would
have had it.
"""

from __future__ import annotations

import gc
import signal
import threading
from collections.abc import Generator
from types import CodeType, FrameType, TracebackType
from typing import TYPE_CHECKING

import pytest

from ..protocol import CLOSE_NOW, PACKAGE_DIR
from ..roles import started_as
from .runtime import RUNTIME

if TYPE_CHECKING:
    from _pytest._code.code import TracebackEntry

PLUGIN_NAME = "xdist-megatron-interrupts"


class Latch:
    """pytest plugin of a driver: remembers a Ctrl-C until pytest has handled its interrupt."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.interrupted = False  # a SIGINT pytest has not handled yet
        # Where the last SIGINT landed, taken then: once the imports it cut short have ended,
        # their frames no longer know their line (f_lineno None).
        self.landing: TracebackType | None = None
        self.held: KeyboardInterrupt | None = None  # raised while the conftest files imported

    def install(self) -> None:
        """Take SIGINT over from Python's default handler (never from anyone else's)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.interrupted = True
        landed = _outside_the_plugin(frame)
        self.landing = _entry(landed) if landed is not None else None
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt, as before

    def hold(self, error: BaseException) -> None:
        """An interrupt (or what it broke: a half-imported numpy fails later imports) during the
        initial conftest files: raised again once the session can report it."""
        if isinstance(error, KeyboardInterrupt):
            self.held = error
        else:
            self.held = KeyboardInterrupt(f"it broke the import ({type(error).__name__})")
            self.held.__cause__ = error

    def raise_if_lost(self) -> None:
        """Raise the interrupt held back, or one that was swallowed since it landed, from the
        frame where it landed: the traceback of the imports it cut short is dropped (pytest took
        seconds to format megatron.core's, with the zygote still running)."""
        held, self.held = self.held, None
        if held is None and self.interrupted:
            held = KeyboardInterrupt("the code it landed in swallowed it")
        if held is None:
            return
        if self.landing is not None:
            held = held.with_traceback(self.landing)
        raise held

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self) -> None:
        self.raise_if_lost()  # before xdist's controller starts its workers

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self) -> None:
        self.raise_if_lost()  # the test modules import libraries too

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        """A test on a gang runs none of its body here: an interrupt lands in the driver's wait
        for the ranks, and is raised at the test instead. One the driver lost meanwhile is
        raised all the same, before the next test: an xdist worker's gang, retired for the
        interrupt, failed to hear from the shared zygote, which the interrupted controller had
        just killed, and that error became the test's report (the worker went on with its next
        test, on a zygote of its own)."""
        runtime = self.config.stash.get(RUNTIME, None)
        if runtime is None or not runtime.runs_on_ranks(item):
            return (yield)
        path, line = item.reportinfo()[:2]
        try:
            outcome = yield
        except KeyboardInterrupt as interrupt:
            raise _at(interrupt, str(path), (line or 0) + 1) from None
        if self.interrupted:
            raise _at(KeyboardInterrupt(), str(path), (line or 0) + 1)
        return outcome

    @pytest.hookimpl(tryfirst=True)
    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        """First of all: end the zygote and the ranks, then let pytest report, from the last
        frame outside the plugin. Everything alive now is frozen out of the garbage collector:
        pytest's unconfigure collects ten times over (for unraisable exceptions in cycles),
        0.2 s a time with megatron.core imported on a 2-core host, which an interrupted run
        waited for."""
        entries = excinfo.traceback.filter(_knows_its_line)
        while len(entries) > 1 and _ours(entries[-1].frame.code.raw):
            entries = entries[:-1]
        excinfo.traceback = entries
        self.interrupted = False
        self.held = None
        self.landing = None
        close_now = self.config.stash.get(CLOSE_NOW, None)
        if close_now is not None:
            close_now()
        gc.freeze()

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self) -> None:
        if signal.getsignal(signal.SIGINT) == self._on_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _outside_the_plugin(frame: FrameType | None) -> FrameType | None:
    """`frame`, or the nearest of its callers whose code is not the plugin's and that knows its
    line: a SIGINT can land on an instruction of no line (seen in enum's class set-up, amid
    torch's imports), and an entry without a line broke pytest's report of the interrupt."""
    while frame is not None and (_ours(frame.f_code) or frame.f_lineno is None):
        frame = frame.f_back
    return frame


def _knows_its_line(entry: TracebackEntry) -> bool:
    """Whether pytest can show `entry`: one at an instruction of no line breaks its report."""
    try:
        return entry.lineno is not None
    except TypeError:
        return False


def _ours(code: CodeType) -> bool:
    return code.co_filename.startswith(PACKAGE_DIR)


def _entry(frame: FrameType) -> TracebackType:
    """A traceback of one entry: `frame`, at the line it is on."""
    return TracebackType(None, frame, frame.f_lasti, frame.f_lineno)


def _at(interrupt: KeyboardInterrupt, path: str, line: int) -> KeyboardInterrupt:
    """`interrupt` with one traceback entry, a frame of `path` at `line` (a test's file and
    line, whose source pytest shows), in place of the driver's frames it landed in."""
    try:
        code = compile("\n" * (line - 1) + "raise interrupt", path, "exec")
        exec(code, {"interrupt": interrupt.with_traceback(None)})
    except KeyboardInterrupt:
        pass
    raised = interrupt.__traceback__  # this frame's entry, then the one at `line`
    return interrupt.with_traceback(raised.tb_next if raised is not None else None)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> Generator[None, None, None]:
    """Around everything that imports the conftest files (and starts the import follower)."""
    if started_as().is_rank:
        return (yield)
    latch = Latch(early_config)
    early_config.pluginmanager.register(latch, PLUGIN_NAME)
    latch.install()
    try:
        return (yield)
    except BaseException as error:
        if not (isinstance(error, KeyboardInterrupt) or latch.interrupted):
            raise
        latch.hold(error)
        return None
