"""Ctrl-C in a driver (the serial pytest process, an xdist controller or worker) ends the run as
pytest ends an interrupted one, wherever it lands: its KeyboardInterrupt summary, exit code 2,
and the zygote and ranks killed at once (`Runtime.close(at_once=True)`).

Two things lost it in the first seconds, while the conftest files import the suite's libraries
(and the import follower starts the zygote beside them):

- Library code may swallow the KeyboardInterrupt: torch's C extension imports numpy at import
  and drops any error of that import, so a Ctrl-C that landed there went unnoticed and the run
  went on into the tests. A SIGINT handler remembers the interrupt until pytest has handled it;
  the session raises it again when it starts and when collection ends.
- A KeyboardInterrupt out of the initial conftest files ends pytest before its session exists:
  a traceback, death by SIGINT, and nobody to stop the zygote. It is held until the session
  starts, which raises it where pytest reports interrupts and cleans up.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Generator
from types import FrameType

import pytest

from ..protocol import on_gang_rank, under_torchrun

PLUGIN_NAME = "xdist-megatron-interrupts"


class Latch:
    """pytest plugin of a driver: remembers a Ctrl-C until pytest has handled its interrupt."""

    def __init__(self) -> None:
        self.interrupted = False  # a SIGINT pytest has not handled yet
        self.landed = "?"  # where the last SIGINT landed: path:line
        self.held: KeyboardInterrupt | None = None  # raised while the conftest files imported

    def install(self) -> None:
        """Take SIGINT over from Python's default handler (never from anyone else's)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.interrupted = True
        if frame is not None:
            self.landed = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt, as before

    def hold(self, error: BaseException) -> None:
        """An interrupt (or what it broke: a half-imported numpy fails later imports) during the
        initial conftest files: raised again once the session can report it."""
        if isinstance(error, KeyboardInterrupt):
            self.held = error
        else:
            why = f"which broke the import ({type(error).__name__})"
            self.held = KeyboardInterrupt(f"Ctrl-C at {self.landed}, {why}")
            self.held.__cause__ = error

    def raise_if_lost(self) -> None:
        """Raise the interrupt held back, or one that was swallowed since it landed."""
        held, self.held = self.held, None
        if held is not None:
            raise held
        if self.interrupted:
            raise KeyboardInterrupt(f"Ctrl-C at {self.landed}, where the code swallowed it")

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self) -> None:
        self.raise_if_lost()  # before xdist's controller starts its workers

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self) -> None:
        self.raise_if_lost()  # the test modules import libraries too

    @pytest.hookimpl(tryfirst=True)
    def pytest_keyboard_interrupt(self) -> None:
        self.interrupted = False
        self.held = None

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self) -> None:
        if signal.getsignal(signal.SIGINT) == self._on_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> Generator[None, None, None]:
    """Around everything that imports the conftest files (and starts the import follower)."""
    if on_gang_rank() or under_torchrun():
        return (yield)
    latch = Latch()
    early_config.pluginmanager.register(latch, PLUGIN_NAME)
    latch.install()
    try:
        return (yield)
    except BaseException as error:
        if not (isinstance(error, KeyboardInterrupt) or latch.interrupted):
            raise
        latch.hold(error)
        return None
