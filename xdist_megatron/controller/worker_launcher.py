"""Stands in for `python` when xdist starts a worker: the worker is forked from the shared zygote,
which has imported torch and the suite's packages already, instead of importing them again.

execnet runs `LAUNCHER ADDRESS -u -c BOOTSTRAP` and speaks to it over its stdin and stdout. This
script hands those descriptors (and stderr, its directory and its environment) to the zygote at
ADDRESS, which forks the worker onto them; then it stays as the worker's stand-in for execnet
and xdist: it passes on SIGINT and SIGTERM, and exits with the worker's exit code (1 where the
zygote died before it could say). If the zygote cannot fork one, the worker starts as a plain
`python -u -c BOOTSTRAP` in its place.

SIGINT or SIGTERM before the worker exists (the zygote may still be importing the suite's
packages) ends the launcher at once, by that signal, and no worker starts: it used to raise
KeyboardInterrupt with a traceback, or fall back to a plain worker once the interrupted
controller had killed the zygote. One Ctrl-C may reach it twice (the terminal's, to the whole
process group, and the controller's, which passes it on to its workers): the worker gets it
once.

Run by path with `python -I`: it imports nothing but the standard library, so that it starts in
milliseconds, and speaks to the zygote in plain tuples (see `zygote/server.py`, FORK_WORKER).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection, wait
from types import FrameType

FORK_WORKER = "fork-worker"  # the request's tag; the zygote's twin of this name says why
SAME_CTRL_C = 1.0  # seconds: a SIGINT this soon after the last one passed on is the same Ctrl-C
PASSED_ON = (signal.SIGINT, signal.SIGTERM)


def main(argv: list[str]) -> int:
    address, python_args = argv[1], argv[2:]
    for signum in PASSED_ON:  # no worker yet: end here, as Python's own SIGTERM would
        signal.signal(signum, _end_by)
    try:
        conn, pid = _fork_worker(address, python_args)
    except (OSError, EOFError, ValueError):  # exec resets the handlers to Python's own
        os.execv(sys.executable, [sys.executable, *python_args])
    for fd in (0, 1, 2):  # only the worker holds execnet's pipes: its exit closes them
        os.close(fd)
    # The worker by a descriptor of its own: a signal never reaches a recycled pid, and the
    # worker's end is seen also once the zygote, which reaps it, is gone.
    try:
        worker: int | None = os.pidfd_open(pid)
    except OSError:  # it has ended already, or the kernel is older than 5.3
        worker = None
    passer = PassOn(worker, pid)
    for signum in PASSED_ON:
        signal.signal(signum, passer)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the zygote died; the worker lives on without it
            if worker is not None:
                wait([worker])
            return 1
        if message[0] == "exited":
            return _exit_as(message[1])


class PassOn:
    """The launcher's SIGINT and SIGTERM handler once the worker exists: the worker gets them,
    a Ctrl-C once."""

    def __init__(self, worker: int | None, pid: int) -> None:
        self.worker = worker  # its pidfd, where the kernel has them
        self.pid = pid
        self.last_ctrl_c = float("-inf")  # when the last SIGINT was passed on

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if now - self.last_ctrl_c < SAME_CTRL_C:
                return
            self.last_ctrl_c = now
        with contextlib.suppress(ProcessLookupError):  # it has just ended
            if self.worker is None:
                os.kill(self.pid, signum)
            else:
                signal.pidfd_send_signal(self.worker, signum)


def _end_by(signum: int, _frame: FrameType | None) -> None:
    """Before the worker exists: end by this signal (the zygote, seeing the connection close,
    kills a worker it forked meanwhile)."""
    _exit_as(-signum)


def _exit_as(code: int) -> int:
    """The worker's exit code, or its death by a signal, as this process's own."""
    if code < 0:
        if -code != signal.SIGKILL:  # SIGKILL's cannot be set, and is the default anyway
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _fork_worker(address: str, python_args: list[str]) -> tuple[Connection, int]:
    """Ask the zygote for the worker: (the connection it reports the worker's end on, the
    worker's pid); ValueError where it refused."""
    code = python_args[python_args.index("-c") + 1]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect("\0" + address)
        conn = Connection(os.dup(sock.fileno()))
        conn.send((FORK_WORKER, os.getcwd(), dict(os.environ), code))
        socket.send_fds(sock, [b"w"], [0, 1, 2])
    reply = conn.recv()
    if reply[0] != "forked":
        raise ValueError(reply)
    return conn, reply[1]


if __name__ == "__main__":
    sys.exit(main(sys.argv))
