"""A faulthandler dump becomes a stack a reader can act on: oldest call first, source lines,
the test's frame marked, the harness folded, threads that run no user code left out."""

from __future__ import annotations

import os
import threading

import _pytest

from xdist_megatron.driver import stacks

HERE = os.path.abspath(__file__)
RUNNER = os.path.join(os.path.dirname(_pytest.__file__), "runner.py")
THREADING = threading.__file__


def dump(*threads: tuple[str, list[tuple[str, int, str]]]) -> str:
    """faulthandler's layout: a header per thread, then its frames, most recent call first."""
    lines = []
    for header, frames in threads:
        lines.append(f"{header} (most recent call first):")
        lines += [f'  File "{path}", line {line} in {name}' for path, line, name in frames]
        lines.append("")
    return "\n".join(lines)


def line_of(text: str) -> int:
    with open(HERE) as f:
        return next(n for n, line in enumerate(f, 1) if text in line and "line_of(" not in line)


def waits_here() -> None:
    pass  # the innermost frame of the dump below


def test_main_thread_in_full_harness_folded_and_test_marked() -> None:
    main = [
        (HERE, line_of("pass  # the innermost"), "waits_here"),
        (HERE, line_of("def test_main_thread_in_full"), "test_main_thread_in_full_harness_folded"),
        (RUNNER, 10, "pytest_runtest_call"),
        (RUNNER, 20, "runtestprotocol"),
    ]
    helper = [(HERE, line_of("def waits_here"), "waits_here"), (THREADING, 1, "run")]
    idle = [(RUNNER, 5, "watch"), (THREADING, 1, "run")]
    threads = stacks.parse(
        dump(("Thread 0x1", idle), ("Thread 0x2", helper), ("Current thread 0x3", main))
    )
    test = stacks.TestFrame.of("t.py::test_main_thread_in_full_harness_folded[2]", HERE)

    assert stacks.innermost_call(threads) == "waits_here"
    text = stacks.render(1, threads, test)
    assert text.splitlines() == [
        "Python stack of rank 1 (most recent call last):",
        "  ... 2 frame(s) of pytest, pluggy and xdist-megatron ...",
        f'  File "{HERE}", line {main[1][1]}, in {main[1][2]}  <-- the test',
        "    def test_main_thread_in_full_harness_folded_and_test_marked() -> None:",
        f'  File "{HERE}", line {main[0][1]}, in waits_here',
        "    pass  # the innermost frame of the dump below",
        "Thread 0x2 of rank 1:",
        f'  File "{THREADING}", line 1, in run',
        f"    {open(THREADING).readline().strip()}",
        f'  File "{HERE}", line {helper[0][1]}, in waits_here',
        "    def waits_here() -> None:",
        "(1 more thread(s) in pytest, threading or xdist-megatron only)",
    ]


def test_a_rank_that_did_not_answer() -> None:
    assert stacks.parse("") == []
    assert stacks.innermost_call([]) is None
    assert stacks.render(0, [], None) == "Python stack of rank 0: (none: the rank did not answer)"


HANG_SUITE = """
import time

import pytest
import torch.distributed as dist

@pytest.mark.world_size(2)
def test_hangs(rank):
    if rank == 1:
        time.sleep(60)
    dist.barrier()
"""


def test_a_timeout_folds_every_frame_of_the_plugin(pytester, run_pytest) -> None:
    """On a real gang, the frames below the test (the zygote, the rank loop, the rank's pytest
    session, pytest, pluggy) are one folded line, and the rank's watch thread is not shown: no
    frame of the package reaches the report."""
    pytester.makepyfile(test_hang=HANG_SUITE)
    result = run_pytest("--megatron-timeout", "3")
    result.assert_outcomes(failed=1)
    source = [text.strip() for text in (pytester.path / "test_hang.py").read_text().splitlines()]
    for rank, waits in ((0, "dist.barrier()"), (1, "time.sleep(60)")):
        line = source.index(waits) + 1
        result.stdout.fnmatch_lines(
            [
                f"Python stack of rank {rank} (most recent call last):",
                "  ... * frame(s) of pytest, pluggy and xdist-megatron ...",
                f'  File "*test_hang.py", line {line}, in test_hangs  <-- the test',
                f"    {waits}",
            ]
        )
    output = result.stdout.str()
    assert output.count("frame(s) of pytest, pluggy and xdist-megatron") == 2, output
    assert "xdist_megatron" not in output
    assert "Thread 0x" not in output
