"""DeepSpeed's `DistributedTest` harness on gangs. DeepSpeed is not installed here: the suite
carries a stand-in of its harness (`unit/common.py`, with the methods, attributes and conftest
hooks of DeepSpeed's own) and of the `deepspeed` state a test pool's process starts from (its
communication backend, its group registry). A test launches on gangs at each of its sizes (one
test per size of a list), with its own process group where it asks for one; its `world_size`
mark is the harness's; its fixtures' launches share files; a test that raises, dies or hangs on
one rank fails alone; a size over the devices starts the harness's own pool."""

from __future__ import annotations

import pytest

HARNESS = """
import inspect
import os
import socket
import tempfile
import time

import pytest
import torch.multiprocessing as mp
from _pytest.fixtures import FixtureLookupError
from _pytest.outcomes import Skipped

import deepspeed
import deepspeed.comm as dist


def get_master_port():
    with socket.socket() as probe:
        probe.bind(("", 0))
        return str(probe.getsockname()[1])


class DistributedExec:
    world_size = 2
    backend = "gloo"
    init_distributed = True
    set_dist_env = True
    exec_timeout = int(os.environ.get("DS_UNITTEST_TIMEOUT", "600"))

    def __call__(self, request):
        self._fixture_kwargs = self._get_fixture_kwargs(request, self.run)
        self._launch_with_file_store(request, self.world_size)

    def _get_fixture_kwargs(self, request, func):
        kwargs = {}
        for name in inspect.getfullargspec(func).args[1:]:
            try:
                kwargs[name] = request.getfixturevalue(name)
            except FixtureLookupError:
                pass
        return kwargs

    def _launch_daemonic_procs(self, num_procs, init_method):
        pool = mp.get_context("forkserver").Pool(num_procs)
        port = get_master_port()
        args = [(rank, num_procs, port, init_method) for rank in range(num_procs)]
        try:
            skip_msgs = pool.starmap_async(self._dist_run, args).get(self.exec_timeout)
        except mp.TimeoutError:
            pytest.exit("Test hanged, exiting", returncode=1)
        finally:
            pool.close()
            pool.join()
        if any(skip_msgs):
            pytest.skip(skip_msgs[0])

    def _launch_non_daemonic_procs(self, num_procs, init_method):
        raise NotImplementedError

    def _launch_procs(self, num_procs, init_method):
        if int(os.environ.get("LOCAL_SIZE", "1")) < num_procs:
            pytest.skip(f"not enough GPUs are available: {num_procs} required")
        self._launch_daemonic_procs(num_procs, init_method)

    def _dist_run(self, local_rank, num_procs, master_port, init_method, skip_msg=""):
        if not dist.is_initialized():
            if self.set_dist_env:
                os.environ.update(
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
                    LOCAL_RANK=str(local_rank), RANK=str(local_rank),
                    LOCAL_SIZE=str(num_procs), WORLD_SIZE=str(num_procs),
                )
            if self.init_distributed:
                deepspeed.init_distributed(
                    dist_backend=self.backend, init_method=init_method,
                    rank=local_rank, world_size=num_procs,
                )
                dist.barrier()
        try:
            self.run(**self._fixture_kwargs)
        except BaseException as e:
            if not isinstance(e, Skipped):
                raise
            skip_msg = e.msg
        return skip_msg

    def _launch_with_file_store(self, request, world_size):
        tmpdir = request.getfixturevalue("tmpdir")
        for procs in [world_size] if isinstance(world_size, int) else world_size:
            with tempfile.NamedTemporaryFile(delete=False, dir=str(tmpdir)) as fp:
                init_method = f"file://{fp.name}"
            self._launch_procs(procs, init_method)
            time.sleep(0.5)


class DistributedFixture(DistributedExec):
    is_dist_fixture = True


class DistributedTest(DistributedExec):
    is_dist_test = True

    @pytest.fixture(autouse=True, scope="class")
    def class_tmpdir(self, tmpdir_factory):
        return tmpdir_factory.mktemp(type(self).__name__)

    def run(self, **fixture_kwargs):
        self._current_test(**fixture_kwargs)

    def __call__(self, request):
        self._current_test = getattr(self, request.function.__name__)
        self._fixture_kwargs = self._get_fixture_kwargs(request, self._current_test)
        for mark in getattr(request.function, "pytestmark", []):
            if mark.name == "world_size":
                world_size = mark.args[0]
                break
        else:
            world_size = self._fixture_kwargs.get("world_size", self.world_size)
        self._launch_with_file_store(request, world_size)
"""

CONFTEST = """
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    if getattr(item.cls, "is_dist_test", False):
        item.cls()(item._request)
        item.runtest = lambda: True
"""

COMM = """
import torch.distributed as torch_dist

cdb = None  # the communication backend: unset in a fresh process


def init_distributed(dist_backend=None, init_method=None, rank=-1, world_size=-1):
    global cdb
    if cdb is None and torch_dist.is_initialized():
        cdb = "the group that was there"
        return
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(
            dist_backend, init_method=init_method, rank=rank, world_size=world_size
        )
    cdb = "a group of its own"


def is_initialized():
    return cdb is not None and torch_dist.is_initialized()


def get_rank():
    assert cdb is not None, "deepspeed.comm is not initialised"
    return torch_dist.get_rank()


def get_world_size():
    assert cdb is not None, "deepspeed.comm is not initialised"
    return torch_dist.get_world_size()


barrier = torch_dist.barrier
all_reduce = torch_dist.all_reduce
"""

SUITE = """
import os
import signal
import time

import pytest
import torch
import torch.distributed

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import groups
from unit.common import DistributedFixture, DistributedTest


class TestAllReduce(DistributedTest):
    world_size = [1, 2]

    def test(self):
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        assert tensor.item() == dist.get_world_size() == int(os.environ["WORLD_SIZE"])
        assert groups.EXPERT_GROUPS == {}, f"left by an earlier test: {groups.EXPERT_GROUPS}"
        groups.EXPERT_GROUPS["experts"] = dist.get_world_size()


class TestRanks(DistributedTest):
    world_size = 2

    @pytest.mark.world_size(1)
    def test_marked_1(self):
        assert dist.get_world_size() == 1

    def test_skips(self):
        pytest.skip("skipped on every rank")

    def test_raises_on_rank_1(self):
        if dist.get_rank() == 1:
            raise ValueError("the test's own failure on rank 1")

    def test_rank_1_dies(self):
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()

    def test_hangs_on_rank_1(self):
        if dist.get_rank() == 1:
            time.sleep(600)

    def test_after_the_faults(self):
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        assert tensor.item() == 2


class TestOwnGroup(DistributedTest):
    init_distributed = False

    def test(self):
        assert not torch.distributed.is_initialized()
        torch.distributed.init_process_group("gloo")  # from the variables _dist_run set
        deepspeed.init_distributed("gloo")
        assert dist.get_world_size() == 2


class _WritesFiles(DistributedFixture):
    world_size = 2

    def run(self, class_tmpdir):
        with open(os.path.join(class_tmpdir, f"{dist.get_rank()}.txt"), "w") as f:
            f.write(os.environ["WORLD_SIZE"])


@pytest.fixture
def files_written(request, class_tmpdir):
    _WritesFiles()(request)


class TestDistributedFixture(DistributedTest):
    world_size = 1

    def test(self, files_written, class_tmpdir):
        written = [open(os.path.join(class_tmpdir, f"{rank}.txt")).read() for rank in (0, 1)]
        assert written == ["2", "2"] and dist.get_world_size() == 1
"""

OVER_THE_DEVICES = """
import deepspeed.comm as dist
from unit.common import DistributedTest


class TestOverTheDevices(DistributedTest):
    world_size = 3  # the run has 2 devices: the harness's own pool

    def test(self):
        assert dist.get_world_size() == 3
"""

EXPECTED = {
    "TestAllReduce::test[ws1]": "PASSED",
    "TestAllReduce::test[ws2]": "PASSED",
    "TestRanks::test_marked_1": "PASSED",
    "TestRanks::test_skips": "SKIPPED",
    "TestRanks::test_raises_on_rank_1": "FAILED",
    "TestRanks::test_rank_1_dies": "FAILED",
    "TestRanks::test_hangs_on_rank_1": "FAILED",
    "TestRanks::test_after_the_faults": "PASSED",
    "TestOwnGroup::test": "PASSED",
    "TestDistributedFixture::test": "PASSED",
}


@pytest.fixture
def deepspeed_suite(pytester: pytest.Pytester) -> pytest.Pytester:
    for package in ("unit", "deepspeed", "deepspeed/comm", "deepspeed/utils"):
        pytester.mkpydir(package)
    files = {
        "unit/common.py": HARNESS,
        "deepspeed/__init__.py": "from .comm.comm import init_distributed\n",
        "deepspeed/comm/__init__.py": "from .comm import *\n",
        "deepspeed/comm/comm.py": COMM,
        "deepspeed/utils/groups.py": "EXPERT_GROUPS = {}  # filled by a test's groups\n",
        "unit/test_suite.py": SUITE,
        "unit/test_over_the_devices.py": OVER_THE_DEVICES,
    }
    for path, text in files.items():
        pytester.path.joinpath(path).write_text(text)
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmegatron_timeout = 6\n")  # the hung test's
    return pytester


def outcomes(result: pytest.RunResult) -> dict[str, str]:
    found = {}
    for line in result.outlines:
        for name in EXPECTED:
            words = [w for w in ("PASSED", "FAILED", "SKIPPED") if w in line]
            if f"::{name} " in line and words:
                found[name] = words[0]
    return found


@pytest.mark.parametrize("mode", ["serial", "xdist"])
def test_tests_launch_on_gangs_with_the_harness_verdicts(deepspeed_suite, run_pytest, mode):
    xdist = ("-n", "2", "--dist", "megatron") if mode == "xdist" else ()
    files = ("unit",) if mode == "serial" else ("unit/test_suite.py",)
    environ = {"LOCAL_SIZE": "4", "DS_UNITTEST_TIMEOUT": "600"}
    result = run_pytest(
        "-v", "-rs", "--megatron-devices", "cpu:2", *xdist, *files, timeout=240, env=environ
    )
    output = result.stdout.str()
    assert outcomes(result) == EXPECTED, output
    assert "ValueError: the test's own failure on rank 1" in output
    assert "the test failed on rank(s) 1" in output
    assert "SIGKILL" in output or "signal 9" in output
    assert "time.sleep(600)" in output  # the hung rank's stack, after 6 s, not 600
    assert "skipped on every rank" in output
    assert "Test hanged" not in output  # the session went on
    assert "spawn harnesses on gangs: DeepSpeed DistributedTest" in output  # the run report
    if mode == "serial":
        assert "DeepSpeed DistributedTest: 10 tests on gangs, 1 with a size over" in output
        assert "TestOverTheDevices::test PASSED" in output
        assert "DeepSpeed DistributedTest: 11 launches on gangs; spawned: 1 size over" in output


MARKED_LIST = """
import pytest

import deepspeed.comm as dist
from unit.common import DistributedTest


class TestMarkedList(DistributedTest):
    @pytest.mark.world_size([1])  # the harness's mark: a list would be a usage error of ours
    def test(self):
        assert dist.get_world_size() == 1
"""


def test_with_harnesses_off_the_suite_spawns_and_its_mark_stays_its_own(
    deepspeed_suite, run_pytest
):
    """--megatron-harnesses off: the harness's own pool runs the test, and its `world_size`
    mark is still not the plugin's marker (a list there was a collection error)."""
    deepspeed_suite.path.joinpath("unit/test_marked_list.py").write_text(MARKED_LIST)
    result = run_pytest(
        "-v", "--megatron-harnesses", "off", "--megatron-devices", "cpu:2",
        "unit/test_marked_list.py", timeout=120, env={"LOCAL_SIZE": "4"},
    )  # fmt: skip
    output = result.stdout.str()
    assert "TestMarkedList::test PASSED" in output, output
    assert "launches on gangs" not in output and "tests on gangs" not in output, output
