"""Invariants 3 and 4: no rank or zygote outlives its session; the rank side imports no test code.

The generated tests record their pids into $FACTS_DIR so that the outer test can check those
exact processes are gone, on top of the tag search of `assert_no_processes_left`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ZYGOTES_OF, assert_gone, assert_no_processes_left

from xdist_megatron.driver.zygote_client import ZygoteClient
from xdist_megatron.protocol import CUDA_AT_IMPORT

FACTS_MODULE = """
import json, os, sys

def record(name, **values):
    values.update(pid=os.getpid(), ppid=os.getppid())
    with open(os.path.join(os.environ["FACTS_DIR"], name + ".jsonl"), "a") as f:
        f.write(json.dumps(values) + "\\n")

def loaded_test_modules():
    return sorted(m for m in sys.modules if m.startswith(("test_", "conftest")))
"""

CONFTEST = """
import pytest

@pytest.fixture
def answer():
    return 42
"""

PASSING = """
import pytest
from facts import loaded_test_modules, record

@pytest.mark.world_size(2)
def test_records(rank, answer):
    record("ranks", rank=rank, modules=loaded_test_modules())
"""

FAILS = """
@pytest.mark.world_size(2)
def test_fails(rank):
    assert rank == 0
"""

HANGS = """
@pytest.mark.world_size(2)
def test_hangs(rank):
    import time
    time.sleep(600)
"""

BLOCKING = """
import time
import pytest
from facts import record

@pytest.mark.world_size(2)
def test_blocks(rank):
    record("ranks", rank=rank)
    time.sleep(600)
"""


def read_facts(folder: Path, name: str) -> list[dict]:
    path = folder / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def gang_pids(facts: list[dict]) -> set[int]:
    """The ranks and their zygote, as the ranks recorded them."""
    return {fact["pid"] for fact in facts} | {fact["ppid"] for fact in facts}


@pytest.fixture
def facts_dir(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the generated tests record facts; a conftest is there too, for invariant 4."""
    folder = pytester.mkdir("facts")
    monkeypatch.setenv("FACTS_DIR", str(folder))
    pytester.makepyfile(facts=FACTS_MODULE)
    pytester.makeconftest(CONFTEST)
    return folder


def test_nothing_outlives_a_timed_out_session(pytester, run_pytest, facts_dir):
    """After a timeout, the recorded ranks and zygote are gone (run_pytest also finds no tagged
    process)."""
    pytester.makepyfile(test_suite=PASSING + HANGS)
    run_pytest("--megatron-timeout", "2").assert_outcomes(passed=1, failed=1)
    facts = read_facts(facts_dir, "ranks")
    assert len(facts) == 2
    assert_gone(gang_pids(facts))


def test_a_session_imports_lazily_and_leaves_nothing_after_a_failure(
    pytester, run_pytest, facts_dir
):
    """Invariant 4 on a live gang: a test module is imported on a rank when its first test runs
    there, the conftest (as under torchrun) when the rank's session starts. Invariant 3 after a
    failure: the recorded ranks and zygote are gone (after a pass, every run_pytest of this suite
    finds no tagged process)."""
    pytester.makepyfile(test_one=PASSING, test_two=PASSING + FAILS)
    run_pytest().assert_outcomes(passed=2, failed=1)
    facts = read_facts(facts_dir, "ranks")
    modules = [fact["modules"] for fact in facts]
    assert modules == [["conftest", "test_one"]] * 2 + [["conftest", "test_one", "test_two"]] * 2
    assert_gone(gang_pids(facts))


BLOCKING_WITH_A_CHILD = """
import subprocess, sys, time
import pytest
from facts import record

@pytest.mark.world_size(2)
def test_blocks(rank):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    record("children", child=child.pid)
    record("ranks", rank=rank)
    time.sleep(600)
"""


SPAWNS_HELPERS = """
import atexit
import multiprocessing
import multiprocessing.managers
import time

import pytest
from facts import record

HELPERS = []  # alive past the test, as a persistent checkpoint writer or a server would be


def serve_forever(ready):
    record("helpers")
    ready.set()
    time.sleep(600)


def say_how_the_manager_ends():
    record("helpers")
    atexit.register(record, "manager_exits")  # runs on a shutdown, not on a kill


@pytest.mark.world_size(2)
def test_starts_helpers(rank):
    context = multiprocessing.get_context("spawn")
    for daemon in (True, False):
        ready = context.Event()
        helper = context.Process(target=serve_forever, args=(ready,), daemon=daemon)
        helper.start()
        assert ready.wait(60), "the helper did not start"
        HELPERS.append(helper)
    manager = multiprocessing.managers.SyncManager(ctx=context)
    manager.start(say_how_the_manager_ends)
    HELPERS.append(manager)
"""


def test_processes_a_test_leaves_running_end_with_its_rank(pytester, run_pytest, facts_dir):
    """A rank ends the multiprocessing children its tests left, as a torchrun rank's normal exit
    would: a manager is shut down (its process exits, it is not killed), a daemonic child is
    terminated, and one an interpreter would wait for is killed after a grace period; with them
    goes their resource tracker (run_pytest finds no tagged process)."""
    pytester.makepyfile(test_helpers=SPAWNS_HELPERS)
    run_pytest().assert_outcomes(passed=1)
    helpers = [fact["pid"] for fact in read_facts(facts_dir, "helpers")]
    assert len(helpers) == 6
    assert_gone(helpers)
    assert len(read_facts(facts_dir, "manager_exits")) == 2


CRASHES_WITH_A_CHILD = """
import json, os, signal, subprocess, sys, time
import pytest
from facts import record


@pytest.mark.world_size(2)
def test_crashes_leaving_a_child(rank):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    record("children", child=child.pid)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # a crash: no exit handler ends the child
    child.wait()  # rank 0: a hang, until the gang is retired and its ranks killed


@pytest.mark.world_size(2)
def test_after_the_crash(rank):
    # On the new gang: the old gang's children went with its ranks, not at the session's end.
    with open(os.path.join(os.environ["FACTS_DIR"], "children.jsonl")) as f:
        children = [json.loads(line)["child"] for line in f]
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{pid}/cmdline") and open(f"/proc/{pid}/cmdline").read()
              for pid in children):  # fmt: skip
        assert time.monotonic() < deadline, children
        time.sleep(0.05)
"""


def test_a_rank_killed_by_a_signal_takes_the_processes_it_started(pytester, run_pytest, facts_dir):
    """A rank that crashes, or hangs and is killed, cannot end the processes its test started:
    each rank leads a process group of its own, and the zygote kills what is left in it when it
    reaps the rank. Both children are gone before the session ends, and the next test runs."""
    pytester.makepyfile(test_crash=CRASHES_WITH_A_CHILD)
    result = run_pytest("--megatron-timeout", "60", "-rA")
    result.assert_outcomes(passed=1, failed=1)
    children = {fact["child"] for fact in read_facts(facts_dir, "children")}
    assert len(children) == 2
    assert_gone(children)


def test_rank_entry_point_imports_no_test_code(pytester, facts_dir):
    """Invariant 4: importing the rank entry point, from a folder holding a conftest and test
    modules, pulls in neither."""
    pytester.makepyfile(test_suite=PASSING)
    code = "import json, sys, xdist_megatron.ranks.rank; print(json.dumps(sorted(sys.modules)))"
    output = subprocess.run(
        [sys.executable, "-c", code], cwd=pytester.path, capture_output=True, text=True, check=True
    ).stdout
    loaded = json.loads(output)
    assert "xdist_megatron.ranks.rank" in loaded
    assert not [m for m in loaded if m.rpartition(".")[2].startswith(("test_", "conftest"))]


def start_blocked_session(
    pytester: pytest.Pytester, facts_dir: Path, *args: str, module: str = BLOCKING
) -> subprocess.Popen:
    """pytest in a subprocess, returned once both ranks of its ws2 test are inside the test."""
    pytester.makepyfile(test_block=module)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--megatron-timeout",
            "300",
            *args,
        ],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while len(read_facts(facts_dir, "ranks")) < 2:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the ranks never started:\n{process.communicate()[0]}")
        time.sleep(0.1)
    return process


@pytest.mark.alone
def test_sigkill_of_the_driver_takes_the_gang_down(pytester, tag, facts_dir):
    """Invariant 3: a driver killed by SIGKILL cannot clean up, yet its zygote and ranks go."""
    process = start_blocked_session(pytester, facts_dir)
    os.kill(process.pid, signal.SIGKILL)
    process.communicate()
    assert_no_processes_left(tag, within=5)
    assert_gone(gang_pids(read_facts(facts_dir, "ranks")))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_driver_takes_the_processes_its_tests_started(pytester, tag, facts_dir, signum):
    """`timeout` ends pytest with SIGTERM, a CI runner with SIGKILL: the zygote, left without
    its owner, ends the process groups of its ranks, so what their tests started goes too."""
    process = start_blocked_session(pytester, facts_dir, module=BLOCKING_WITH_A_CHILD)
    os.kill(process.pid, signum)
    process.communicate()
    children = {fact["child"] for fact in read_facts(facts_dir, "children")}
    assert len(children) == 2
    assert_gone(children)
    assert_no_processes_left(tag, within=5)


HOLDS_THE_ZYGOTE_SOCKET = """
import os, time
from facts import record

def pytest_runtest_logstart(nodeid, location):
    if "RANK" in os.environ:  # the driver's hook only
        return
    pid = os.fork()  # as a fixture's fork-started server would: it holds every fd of the driver
    if pid == 0:  # it keeps the socket, not the output pipes the outer test reads to their end
        try:
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                        os.close(int(fd))
                except OSError:
                    pass
            time.sleep(600)
        finally:
            os._exit(0)
    record("holders", holder=pid)
"""


def test_a_driver_killed_while_another_process_holds_its_zygote_socket(pytester, tag, facts_dir):
    """A process the driver forked (a fixture's server) keeps the driver's end of the zygote's
    socket open: SIGKILL of the driver then reaches the zygote only as its new parent, and the
    zygote still ends its ranks' process groups, so what their tests started goes too."""
    pytester.makeconftest(CONFTEST + HOLDS_THE_ZYGOTE_SOCKET)
    process = start_blocked_session(pytester, facts_dir, module=BLOCKING_WITH_A_CHILD)
    holders = {fact["holder"] for fact in read_facts(facts_dir, "holders")}
    try:
        os.kill(process.pid, signal.SIGKILL)
        process.communicate(timeout=60)
        children = {fact["child"] for fact in read_facts(facts_dir, "children")}
        assert len(children) == 2
        assert_gone(children)
    finally:
        for holder in holders:
            os.kill(holder, signal.SIGKILL)
    assert_no_processes_left(tag, within=5)


def test_sigkill_of_the_xdist_controller_takes_workers_zygote_and_ranks_down(
    pytester, tag, facts_dir
):
    """Under xdist the workers share the controller's zygote: killing the controller with
    SIGKILL still leaves no worker, zygote or rank behind."""
    process = start_blocked_session(pytester, facts_dir, "-n", "2", "--dist", "megatron")
    os.kill(process.pid, signal.SIGKILL)
    process.communicate()
    assert_no_processes_left(tag, within=15)
    assert_gone(gang_pids(read_facts(facts_dir, "ranks")))


@pytest.mark.alone
def test_ctrl_c_interrupts_a_hanging_test_and_leaves_nothing(pytester, tag, facts_dir):
    """Invariant 3: SIGINT during a test on a gang ends pytest as an interrupt (exit code 2)."""
    process = start_blocked_session(pytester, facts_dir)
    os.kill(process.pid, signal.SIGINT)
    try:
        output = process.communicate(timeout=30)[0]
    finally:
        process.kill()
    assert process.returncode == 2, output
    assert "KeyboardInterrupt" in output
    assert_no_processes_left(tag, within=5)
    assert_gone(gang_pids(read_facts(facts_dir, "ranks")))


@pytest.mark.alone
def test_sigint_to_the_xdist_controller_ends_the_ranks_at_once(pytester, tag, facts_dir):
    """A CI runner's cancel (SIGINT to the controller, not a terminal's Ctrl-C to the whole
    group): the ranks and the zygote are gone within a second (they used to outlive it by 5 s
    while execnet waited for the busy workers); the rest follows."""
    process = start_blocked_session(pytester, facts_dir, "-n", "2", "--dist", "megatron")
    ranks = gang_pids(read_facts(facts_dir, "ranks"))
    os.kill(process.pid, signal.SIGINT)
    try:
        assert_gone(ranks, within=1.5)  # 1 s, and a margin for a loaded CI machine
        process.communicate(timeout=60)
    finally:
        process.kill()
    assert_no_processes_left(tag, within=15)


def test_packages_outside_the_project_are_preloaded(
    pytester, run_pytest, tmp_path_factory, monkeypatch
):
    """A package on PYTHONPATH outside the rootdir (a `pip install --target` folder) is
    third-party: the zygote imports it once, so a rank finds it already imported by its parent;
    the project's own helper module is not preloaded (each rank imports it). The zygote runs as
    `python -m xdist_megatron.zygote`: the package must not import that module first, or
    it runs twice and Python warns (shown with -s) on the terminal of every session."""
    vendored = tmp_path_factory.mktemp("vendored")
    (vendored / "vendored_lib").mkdir()
    (vendored / "vendored_lib" / "__init__.py").write_text("import os\nIMPORTED_BY = os.getpid()\n")
    pytester.makepyfile(
        local_helper="import os\nIMPORTED_BY = os.getpid()\n",
        test_preload="""
import os
import local_helper
import pytest
import vendored_lib

@pytest.mark.world_size(1)
def test_where_imported():
    assert vendored_lib.IMPORTED_BY == os.getppid()  # the zygote
    assert local_helper.IMPORTED_BY == os.getpid()  # this rank
""",
    )
    monkeypatch.setenv("PYTHONPATH", str(vendored), prepend=os.pathsep)
    result = run_pytest("-s", "--megatron-timeout", "60")
    result.assert_outcomes(passed=1)
    assert "found in sys.modules" not in result.stderr.str() + result.stdout.str()


def test_project_libraries_are_preloaded_test_helpers_are_not(pytester, run_pytest):
    """The project's own library beside its tests (Megatron-LM's `megatron/training`, imported by
    its unit tests' conftest) is preloaded like an installed one; a helper module in the tests'
    folder, and a package named test*, stay for each rank to import."""
    record = "import os\nIMPORTED_BY = os.getpid()\n"
    pytester.mkpydir("mylib").joinpath("__init__.py").write_text(record)
    pytester.mkpydir("testing_utils").joinpath("__init__.py").write_text(record)
    tests = pytester.mkdir("tests")
    (tests / "conftest.py").write_text("import mylib\nimport testing_utils\n")
    (tests / "helper.py").write_text(record)
    (tests / "test_where.py").write_text(
        """
import os
import helper
import mylib
import pytest
import testing_utils

@pytest.mark.world_size(1)
def test_where_imported():
    assert mylib.IMPORTED_BY == os.getppid()  # the zygote
    assert helper.IMPORTED_BY == os.getpid()  # this rank
    assert testing_utils.IMPORTED_BY == os.getpid()
"""
    )
    result = run_pytest("--megatron-timeout", "60", "tests")
    result.assert_outcomes(passed=1)


def test_helpers_below_a_conftest_folder_are_not_preloaded(pytester, run_pytest, monkeypatch):
    """Model-Optimizer's layout: a root conftest, `tests/conftest.py`, test folders with their
    own conftest, and helpers in `tests/_test_utils` imported through the ini's `pythonpath`
    (here also on PYTHONPATH, so a zygote could import them). The helpers are test code: each
    rank imports them, though no test module or conftest lies in their own folder (pytest keeps
    one `conftest` in sys.modules at a time, so the folders of the others were missed, and the
    zygote was told to preload the helpers). The root conftest does not make the project's own
    library beside the tests test code."""
    record = "import os\nIMPORTED_BY = os.getpid()\n"
    monkeypatch.setenv("PYTHONPATH", str(pytester.path / "tests"), prepend=os.pathsep)
    pytester.makeini("[pytest]\npythonpath = tests\n")
    pytester.makeconftest("")
    pytester.mkpydir("mylib").joinpath("__init__.py").write_text(record)
    tests = pytester.mkdir("tests")
    (tests / "conftest.py").write_text("import _test_utils\n")
    helpers = tests / "_test_utils"
    helpers.mkdir()
    (helpers / "__init__.py").write_text(record)
    (helpers / "models.py").write_text(record)
    unit = tests / "unit"
    unit.mkdir()
    (unit / "conftest.py").write_text("")
    (unit / "test_where.py").write_text(
        """
import os
import pytest
import mylib
from _test_utils import models

@pytest.mark.world_size(1)
def test_where_imported():
    assert mylib.IMPORTED_BY == os.getppid()  # the zygote
    assert models.IMPORTED_BY == os.getpid()  # this rank
"""
    )
    result = run_pytest("--megatron-timeout", "60", "tests", cache=True)
    result.assert_outcomes(passed=1)
    preloads = pytester.path / ".pytest_cache" / "v" / "xdist_megatron" / "preload"
    assert json.loads(preloads.read_text()) == ["mylib"]


def test_a_flat_suites_helper_packages_are_not_preloaded(pytester, run_pytest):
    """Test modules in the rootdir itself make every folder under it test code: a helper
    package beside them stays for each rank to import."""
    pytester.mkpydir("helpers").joinpath("__init__.py").write_text(
        "import os\nIMPORTED_BY = os.getpid()\n"
    )
    pytester.makepyfile(
        test_flat="""
import os
import helpers
import pytest

@pytest.mark.world_size(1)
def test_where_imported():
    assert helpers.IMPORTED_BY == os.getpid()  # this rank
"""
    )
    run_pytest("--megatron-timeout", "60").assert_outcomes(passed=1)


EARLY_SUITE = f"""
import os
import pytest
import vendored_lib

{ZYGOTES_OF}
ZYGOTES_DURING_COLLECTION = zygotes_of(os.getpid())

def test_collection_saw():
    now = zygotes_of(os.getpid())
    print("zygotes during collection:", ZYGOTES_DURING_COLLECTION, "at test time:", now)

@pytest.mark.world_size(1)
def test_preloaded_by_the_zygote():
    assert vendored_lib.IMPORTED_BY == os.getppid()
"""


@pytest.mark.parametrize("known_by", ["cache", "ini"])
def test_known_preloads_start_the_zygote_before_collection(
    pytester, run_pytest, tmp_path_factory, monkeypatch, known_by
):
    """Preloads known before collection (megatron_preload, or remembered in the pytest cache by
    the last session that ran gangs) start the zygote at session start, so its imports overlap
    with the collection's; a session whose collection finds no marked test stops it again."""
    vendored = tmp_path_factory.mktemp("vendored")
    (vendored / "vendored_lib").mkdir()
    (vendored / "vendored_lib" / "__init__.py").write_text("import os\nIMPORTED_BY = os.getpid()\n")
    monkeypatch.setenv("PYTHONPATH", str(vendored), prepend=os.pathsep)
    pytester.makepyfile(test_early=EARLY_SUITE)
    if known_by == "ini":
        pytester.makeini("[pytest]\nmegatron_preload = vendored_lib\n")
    else:
        first = run_pytest("-s", "--megatron-timeout", "60", cache=True)
        first.assert_outcomes(passed=2)
        first.stdout.fnmatch_lines(["*zygotes during collection: []*"])
    again = run_pytest("-s", "--megatron-timeout", "60", cache=True)
    again.assert_outcomes(passed=2)
    again.stdout.fnmatch_lines(["*zygotes during collection: [[][0-9]*"])
    unmarked_only = run_pytest("-s", "-k", "collection_saw", cache=True)
    unmarked_only.assert_outcomes(passed=1, deselected=1)
    unmarked_only.stdout.fnmatch_lines(["*zygotes during collection: [[][0-9]*] at test time: []"])


FOLLOWED_CONFTEST = f"""
import os, time
import torch  # the suite's first import of torch starts the zygote

{ZYGOTES_OF}
if "RANK" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:  # driver, controller
    deadline = time.monotonic() + 60
    while not zygotes_of(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    print("zygotes while the conftest imported:", zygotes_of(os.getpid()))
"""


@pytest.mark.parametrize("mode", ["serial", "xdist"])
def test_the_zygote_starts_while_the_conftest_imports(pytester, run_pytest, monkeypatch, mode):
    """Without remembered or configured preloads, the zygote starts as soon as the driver (or
    the xdist controller) imports torch, while its conftest files still import, not after
    collection; a session without gangs stops it, and one that never imports torch has none."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # this test may run in a worker
    pytester.makeconftest(FOLLOWED_CONFTEST)
    pytester.makepyfile(
        test_followed="""
import pytest

@pytest.mark.world_size(2)
def test_on_gang(rank):
    pass

def test_local():
    pass
"""
    )
    xdist = ["-n", "2", "--dist", "megatron"] if mode == "xdist" else []
    result = run_pytest("-s", "--megatron-timeout", "60", *xdist)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*zygotes while the conftest imported: [[][0-9]*"])
    # an option of the plugin engages it before collection (without one, an unmarked run starts
    # nothing: test_unused.py), so the zygote starts with torch and the run without gangs stops it
    unmarked_only = run_pytest("-s", "-k", "local", "--megatron-timeout", "60", *xdist)
    assert unmarked_only.parseoutcomes()["passed"] == 1
    unmarked_only.stdout.fnmatch_lines(["*zygotes while the conftest imported: [[][0-9]*"])


def test_a_suite_that_never_imports_torch_starts_no_zygote(pytester, run_pytest):
    pytester.makepyfile(
        test_plain=f"""
import os
import time

{ZYGOTES_OF}
def test_plain():
    time.sleep(0.3)  # longer than the import follower's poll
    assert zygotes_of(os.getpid()) == []
    assert "torch" not in __import__("sys").modules
"""
    )
    run_pytest("-s").assert_outcomes(passed=1)


def test_a_preload_that_fails_is_named_in_the_summary(pytester, run_pytest):
    """A configured preload that does not import leaves the zygote working (each rank imports
    what its test needs) and is named, with its error, in the run's summary."""
    pytester.makeini("[pytest]\nmegatron_preload = no_such_module_here\n")
    pytester.makepyfile(
        test_runs="""
import pytest

@pytest.mark.world_size(2)
def test_runs(rank):
    pass
"""
    )
    result = run_pytest("--megatron-timeout", "60")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["*xdist-megatron*", "megatron_preload: no_such_module_here: ModuleNotFoundError*"]
    )


def test_a_preload_error_that_mentions_cuda_does_not_stop_the_zygote(tmp_path, monkeypatch, tag):
    """Only a typed signal (a preload that touched the CUDA driver) makes the zygote refuse
    forks; an import error whose text says "CUDA" is an ordinary failure (the zygote used to
    look for that word, and exit, killing every driver's ranks)."""
    from xdist_megatron.driver.gang import Gang
    from xdist_megatron.driver.zygote_client import ZygoteClient
    from xdist_megatron.placement import parse_devices

    (tmp_path / "needs_a_gpu.py").write_text('raise ImportError("no CUDA driver on this host")\n')
    monkeypatch.setenv("PYTHONPATH", str(tmp_path), prepend=os.pathsep)
    zygote = ZygoteClient(["torch", "needs_a_gpu"], None, cuda=True)
    try:
        assert "CUDA" in zygote.preload_failures["needs_a_gpu"]
        assert zygote.breaks_cuda == []
        devices = parse_devices("cpu:2", 0, os.cpu_count() or 1, None)
        with Gang(2, devices, (0, 1), "gloo", zygote=zygote) as gang:
            assert gang.run(os.getpid) != []
        assert zygote.alive
    finally:
        zygote.close()
    assert_no_processes_left(tag)


RECORDS_ITS_IMPORTER = """
import os

with open(os.environ["IMPORTERS"], "a") as f:
    f.write(f"{os.getpid()}\\n")
"""


def test_a_careful_zygote_tries_its_preloads_in_forks_it_reaps(tag, tmp_path, monkeypatch) -> None:
    """The zygote that replaces one a preload spoilt for GPUs imports each preload in a fork
    first. On CPU no import initialises CUDA, so every module is then imported for real, a
    broken one is reported as before, and no trial fork outlives its import."""
    (tmp_path / "records_its_importer.py").write_text(RECORDS_ITS_IMPORTER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path), prepend=os.pathsep)
    importers = tmp_path / "importers"
    monkeypatch.setenv("IMPORTERS", str(importers))
    client = ZygoteClient(
        ["records_its_importer", "no_such_module_here"], None, cuda=True, careful=True
    )
    try:
        failures = client.preload_failures
        assert list(failures) == ["no_such_module_here"]
        assert "ModuleNotFoundError" in failures["no_such_module_here"]
        assert not client.breaks_cuda
        trial, real = importers.read_text().split()
        assert int(real) == client.pid and int(trial) != client.pid
        assert not os.path.exists(f"/proc/{trial}")  # reaped by the zygote, not a zombie
    finally:
        client.close()
    assert_no_processes_left(tag)


SPOILS_CUDA = """
import os
import torch

with open(os.environ["SPOILER_IMPORTERS"], "a") as f:
    f.write(f"{os.getpid()}\\n")
torch.cuda._initialized = True  # what an import that initialised CUDA leaves in torch
"""


def test_a_careful_zygote_tries_a_package_once_for_all_its_modules(
    tag, tmp_path, monkeypatch
) -> None:
    """Packages are tried before the modules under them: one whose import initialises CUDA
    (`modelopt`, above 20 of Model-Optimizer's preloads) is tried once and leaves its modules to
    the ranks untried; one that does not is imported in the zygote before its modules are tried,
    so no trial imports it again, and they are preloaded. (On CPU the package sets torch's
    CUDA-initialised flag, as an import that initialised CUDA leaves it.)"""
    for package, init in (("spoiler", SPOILS_CUDA), ("fine", RECORDS_ITS_IMPORTER)):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(init)
        for module in ("a", "b", "c"):
            (tmp_path / package / f"{module}.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path), prepend=os.pathsep)
    monkeypatch.setenv("IMPORTERS", str(tmp_path / "fine-importers"))
    monkeypatch.setenv("SPOILER_IMPORTERS", str(tmp_path / "spoiler-importers"))
    preloads = [f"{package}.{module}" for package in ("spoiler", "fine") for module in "abc"]
    client = ZygoteClient(preloads, None, cuda=True, careful=True)
    try:
        failures = client.preload_failures
        assert not client.breaks_cuda
        spoilt = ["spoiler", "spoiler.a", "spoiler.b", "spoiler.c"]
        assert failures == dict.fromkeys(spoilt, CUDA_AT_IMPORT)
        assert len((tmp_path / "spoiler-importers").read_text().split()) == 1  # one trial
        trial, real = (tmp_path / "fine-importers").read_text().split()
        assert int(real) == client.pid and int(trial) != client.pid
    finally:
        client.close()
    assert_no_processes_left(tag)
