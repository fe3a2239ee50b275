"""The worker launcher (controller/worker_launcher.py), which stands in for `python` when execnet
starts an xdist worker: the worker is forked from a real zygote onto the launcher's pipes, its
exit code (or the signal that killed it) comes back as the launcher's own, the launcher's
SIGTERM reaches it, a Ctrl-C once, and a launcher killed outright takes the worker with it. A
Ctrl-C before the worker exists ends the launcher quietly, by SIGINT."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from conftest import alive, assert_gone, assert_no_processes_left

from xdist_megatron.controller.hooks import LAUNCHER
from xdist_megatron.controller.worker_launcher import SAME_CTRL_C
from xdist_megatron.driver.zygote_client import ZygoteClient, shared_address

WHO_AM_I = """
import os, sys
line = sys.stdin.readline().strip()
with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
    parent = f.read().split(b"\\0")
forked = b"xdist_megatron.zygote" in parent
print(line, os.getcwd(), os.environ.get("LAUNCHER_TEST"), sys.argv, forked)
"""


@pytest.fixture
def zygote(tag: str) -> Iterator[ZygoteClient]:
    """A zygote listening on an address, as the xdist controller starts one."""
    client = ZygoteClient(["torch", "numpy"], None, address=shared_address(), cuda=False)
    assert not client.preload_failures
    yield client
    client.close()
    assert_no_processes_left(tag)


def launch(address: str, code: str, **kwargs) -> subprocess.Popen:
    command = [sys.executable, "-I", str(LAUNCHER), address, "-u", "-c", code]
    return subprocess.Popen(command, text=True, **kwargs)


def test_the_worker_is_forked_onto_the_launchers_pipes(zygote, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LAUNCHER_TEST", "seen")
    process = launch(
        zygote.address, WHO_AM_I, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    out, _ = process.communicate("hello\n", timeout=60)
    assert process.returncode == 0
    assert out.split() == ["hello", str(tmp_path), "seen", "['-c']", "True"]


AS_PYTHON_WOULD = """
import signal, sys
print(sorted(name for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGPIPE", "SIGXFSZ")
             if signal.getsignal(getattr(signal, name)) not in (signal.SIG_DFL, None)))
print(sys.argv, __name__, "__file__" in globals())
sys.exit("bye")
"""


def test_the_worker_is_what_python_u_c_would_be(zygote) -> None:
    """Signal dispositions, argv, __main__ and the exit of `sys.exit("bye")`, beside a plain
    `python -u -c` of the same code."""
    forked = launch(zygote.address, AS_PYTHON_WOULD, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE)  # fmt: skip
    plain = subprocess.Popen([sys.executable, "-u", "-c", AS_PYTHON_WOULD], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    ours, theirs = forked.communicate(timeout=60), plain.communicate(timeout=60)
    assert ours == theirs and forked.returncode == plain.returncode == 1, (ours, theirs)


@pytest.mark.parametrize(
    ("code", "returncode"),
    [("import sys; sys.exit(3)", 3), ("import os, signal; os.kill(os.getpid(), 9)", -9)],
    ids=["exit-code", "killed"],
)
def test_the_workers_end_is_the_launchers(zygote, code: str, returncode: int) -> None:
    process = launch(zygote.address, code)
    assert process.wait(timeout=60) == returncode


def test_sigterm_reaches_the_worker(zygote) -> None:
    process = launch(zygote.address, "import time; print('up', flush=True); time.sleep(60)",
                     stdout=subprocess.PIPE)  # fmt: skip
    assert process.stdout.readline().strip() == "up"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM


COUNTS_CTRL_C = """
import signal, sys, time
seen = []
signal.signal(signal.SIGINT, lambda *_: seen.append(1))
print("up", flush=True)
sys.stdin.readline()
print(len(seen))
"""


@pytest.mark.alone
def test_one_ctrl_c_reaching_the_launcher_twice_reaches_the_worker_once(zygote) -> None:
    """A terminal's Ctrl-C reaches the launcher, in pytest's process group, and the xdist
    controller passes it on to its workers as well: the worker, in a group of its own, gets it
    once. A later one, a second Ctrl-C, reaches it too."""
    process = launch(zygote.address, COUNTS_CTRL_C, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdout.readline().strip() == "up"
    time.sleep(0.5)  # the launcher passes signals on once it has heard of the fork
    # the last pause lets the launcher pass the second Ctrl-C on before the worker is asked to
    # report (on a loaded machine its handler ran after the report line had been read)
    for pause in (0.1, SAME_CTRL_C + 1.0, 1.0):
        process.send_signal(signal.SIGINT)
        time.sleep(pause)
    out, _ = process.communicate("report\n", timeout=30)
    assert out.strip() == "2" and process.returncode == 0


@pytest.mark.alone
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_before_the_fork_ends_the_launcher_by_it(tag: str, signum: int) -> None:
    """A zygote still importing has not answered: Ctrl-C (or SIGTERM) ends the launcher at
    once, by that signal, with nothing printed (it raised KeyboardInterrupt with a traceback),
    and the zygote going away afterwards starts no worker."""
    address = shared_address()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as busy:  # answers nobody
        busy.bind("\0" + address)
        busy.listen()
        process = launch(address, "print('a worker ran')", stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)  # fmt: skip
        busy.settimeout(30)
        request, _ = busy.accept()
        time.sleep(0.3)  # it waits for the answer
        process.send_signal(signum)
        process.wait(timeout=30)
        request.close()
    out, err = process.communicate(timeout=30)
    assert (process.returncode, out, err) == (-signum, "", "")


def test_a_launcher_killed_outright_takes_its_worker(zygote) -> None:
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    process = launch(zygote.address, code, stdout=subprocess.PIPE)
    worker = int(process.stdout.readline())
    process.kill()
    process.wait(timeout=30)
    assert_gone({worker}, within=10)


def test_the_worker_outlives_a_zygote_that_dies(zygote) -> None:
    """A worker is no rank: the zygote's death leaves it running, and the launcher stays its
    stand-in until it ends (with 1: nobody is left to say its exit code)."""
    code = "import os, sys; print(os.getpid(), flush=True); sys.stdin.readline(); print('done')"
    process = launch(zygote.address, code, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    worker = int(process.stdout.readline())
    zygote.process.kill()
    zygote.process.wait()
    time.sleep(0.5)
    assert alive(worker) and process.poll() is None
    out, _ = process.communicate("go on\n", timeout=30)
    assert out.strip() == "done" and process.returncode == 1


def test_workers_draw_different_random_numbers(zygote) -> None:
    """As workers started afresh do (a port or a temporary name drawn from a state the forks of
    one zygote shared would collide): `random` and numpy reseed in a forked child."""
    code = "import random, numpy; print(numpy.random.random(), random.random())"
    draws = []
    for _ in range(2):
        process = launch(zygote.address, code, stdout=subprocess.PIPE)
        draws.append(process.communicate(timeout=60)[0].split())
    assert draws[0][0] != draws[1][0] and draws[0][1] != draws[1][1], draws


def test_without_a_zygote_the_worker_starts_as_plain_python(tag: str) -> None:
    process = launch("no-such-zygote", "import sys; print(sys.argv)", stdout=subprocess.PIPE)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and out.strip() == "['-c']"
