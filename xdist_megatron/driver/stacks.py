"""A hung rank's faulthandler dump made readable, as pytest-timeout shows stacks: oldest call
first, each frame with its source line, the test's own frame marked, and the frames of pytest,
pluggy and this plugin (the same ~30 on every rank) folded into one line.

faulthandler is what can dump a rank stuck inside a collective (it writes from a signal handler,
without the GIL), but it gives only file, line and function; the driver, on the same host, reads
the source lines back from the files.
"""

from __future__ import annotations

import linecache
import os
import re
from dataclasses import dataclass, field

import _pytest
import pluggy

from ..protocol import PACKAGE_DIR

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_HARNESS_DIRS = (
    os.path.dirname(_pytest.__file__) + os.sep,
    os.path.dirname(pluggy.__file__) + os.sep,
    PACKAGE_DIR,  # the whole package (ranks/: the zygote, the rank loop, its watch thread)
)
_THREADING = os.sep + "threading.py"


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    function: str

    @property
    def in_harness(self) -> bool:
        """pytest, pluggy, this plugin, or the interpreter's start-up: never the cause."""
        return self.path.startswith(_HARNESS_DIRS) or self.path.startswith("<frozen ")


@dataclass
class Thread:
    ident: str
    current: bool  # the thread faulthandler's signal interrupted: the rank's main thread
    frames: list[Frame] = field(default_factory=list)  # oldest call first


@dataclass(frozen=True)
class TestFrame:
    """Where the test's own function runs: its frame is marked in the stack."""

    path: str
    function: str

    @classmethod
    def of(cls, nodeid: str, module_path: str) -> TestFrame:
        name = nodeid.rsplit("::", 1)[-1].split("[", 1)[0]
        return cls(os.path.abspath(module_path), name)


def parse(dump: str) -> list[Thread]:
    """faulthandler's text (most recent call first per thread) as threads, oldest call first."""
    threads: list[Thread] = []
    for text in dump.splitlines():
        if match := _THREAD.match(text):
            threads.append(Thread(match[2], match[1] == "Current thread"))
        elif (match := _FRAME.match(text)) and threads:
            threads[-1].frames.insert(0, Frame(match[1], int(match[2]), match[3]))
    return threads


def innermost_call(threads: list[Thread]) -> str | None:
    """The function the main thread is in, outside the harness: what the rank waits on."""
    for thread in threads:
        if thread.current:
            outside = [f for f in thread.frames if not f.in_harness]
            return outside[-1].function if outside else None
    return None


def render(rank: int, threads: list[Thread], test: TestFrame | None) -> str:
    """The main thread in full; other threads only where they run code outside the harness."""
    if not threads:
        return f"Python stack of rank {rank}: (none: the rank did not answer)"
    main = [t for t in threads if t.current] or threads[:1]
    others = [t for t in threads if t not in main]
    shown = [t for t in others if any(_is_user_code(f) for f in t.frames)]
    lines = [f"Python stack of rank {rank} (most recent call last):"]
    lines += _render_frames(main[0].frames, test)
    for thread in shown:
        lines += [f"Thread {thread.ident} of rank {rank}:", *_render_frames(thread.frames, test)]
    if hidden := len(others) - len(shown):
        lines.append(f"({hidden} more thread(s) in pytest, threading or xdist-megatron only)")
    return "\n".join(lines)


def _is_user_code(frame: Frame) -> bool:
    return not frame.in_harness and not frame.path.endswith(_THREADING)


def _render_frames(frames: list[Frame], test: TestFrame | None) -> list[str]:
    lines: list[str] = []
    folded = 0
    for frame in frames:
        if frame.in_harness:
            folded += 1
            continue
        if folded:
            lines.append(_fold(folded))
            folded = 0
        is_test = test is not None and (frame.path, frame.function) == (test.path, test.function)
        mark = "  <-- the test" if is_test else ""
        lines.append(f'  File "{frame.path}", line {frame.line}, in {frame.function}{mark}')
        if source := linecache.getline(frame.path, frame.line).strip():
            lines.append(f"    {source}")
    if folded:
        lines.append(_fold(folded))
    return lines


def _fold(count: int) -> str:
    return f"  ... {count} frame(s) of pytest, pluggy and xdist-megatron ..."
