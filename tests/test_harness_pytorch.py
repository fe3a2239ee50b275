"""PyTorch's own spawn harness (`MultiProcessTestCase` and `MultiProcContinuousTest`, from the
installed torch) on gangs: each fault a spawned child can meet gives the verdict the harness's
parent gives, a continuous class's failure poisons the rest of its class only, and a test that
checks its children's exit codes still spawns them.

The expected outcomes are the harness's own (torch's `_check_return_codes`): run the generated
module with `-p no:xdist_megatron.plugin` to see them spawn.
"""

from __future__ import annotations

import pytest

from xdist_megatron.protocol import RUN_DEVICE_COUNT_VAR

pytest.importorskip("expecttest")  # torch.testing._internal needs it (the test extra has it)

HARNESS_SUITE = """
import datetime
import os
import signal
import sys
import time
import unittest

# On a rank: whether its zygote imported the harness (it must not: TEST_CUDA calls cuInit).
HARNESS_BEFORE_US = "torch.testing._internal.common_utils" in sys.modules

import torch
import torch.distributed as dist
from torch.testing._internal import common_distributed
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    MultiProcessTestCase,
    skip_if_lt_x_gpu,
)

common_distributed.TIMEOUT_OVERRIDE["test_5_hangs_on_rank_1"] = 4


class Shared:
    failures_seen = 0  # what a failing test leaves behind in a child that would not exist


class TestOnGangs(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        os.environ["SET_BY_THE_PARENT"] = self.id()
        if self._testMethodName == "test_8_checks_its_exit_code":
            self.special_return_code_checks[self.test_8_checks_its_exit_code.__wrapped__] = 3
        self._spawn_processes()

    def _join(self):
        dist.init_process_group(
            "gloo", init_method=f"file://{self.file_name}", rank=self.rank, world_size=2
        )
        dist.barrier()  # a rank that ended its group at once could leave its peer connecting

    def test_0_all_reduce(self):
        self._join()
        tensor = torch.ones(1) * (self.rank + 1)
        dist.all_reduce(tensor)
        self.assertEqual(tensor.item(), 3)
        self.assertEqual(os.environ["SET_BY_THE_PARENT"], self.id())
        self.assertEqual(os.environ.get("RANK"), None)

    def test_1_fails_on_rank_1_and_leaves_state(self):
        self._join()
        Shared.failures_seen += 1
        self.assertEqual(self.rank, 0)

    def test_1b_init_fails_on_rank_1(self):
        if self.rank == 1:  # its peer never comes
            dist.init_process_group(
                "gloo",
                init_method=f"file://{self.file_name}",
                rank=1,
                world_size=2,
                timeout=datetime.timedelta(seconds=2),
            )

    def test_2_starts_fresh(self):
        self._join()
        self.assertEqual(Shared.failures_seen, 0)

    @skip_if_lt_x_gpu(2)
    def test_3_skips_by_exit_code(self):
        pass

    def test_4_rank_0_exits_with_3(self):
        self._join()
        dist.barrier()
        if self.rank == 0:
            sys.exit(3)

    def test_5_hangs_on_rank_1(self):
        self._join()
        dist.barrier()  # rank 0 ends its group only once rank 1 has joined it
        if self.rank == 1:
            time.sleep(600)

    def test_6_rank_1_dies(self):
        self._join()
        if self.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()

    def test_7_after_the_death(self):
        self._join()
        dist.barrier()

    def test_8_checks_its_exit_code(self):
        sys.exit(3)

    def test_9_skip_test(self):
        raise unittest.SkipTest("skipped in the child")

    def test_a_the_zygote_imported_no_harness(self):
        self.assertFalse(HARNESS_BEFORE_US)


class GlooOnTwo(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    @classmethod
    def device_type(cls):
        return "cpu"


class TestContinuous(GlooOnTwo):
    def test_c0_all_reduce_on_the_class_group(self):
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        self.assertEqual(tensor.item(), 2)
        self.assertEqual(os.environ["LOCAL_RANK"], str(self.rank))

    def test_c1_fails_on_rank_1(self):
        self.assertEqual(self.rank, 0)

    def test_c2_poisoned(self):
        pass


class TestContinuousAfterAPoisonedClass(GlooOnTwo):
    def test_d0_a_fresh_group(self):
        tensor = torch.ones(1) * (self.rank + 1)
        dist.all_reduce(tensor)
        self.assertEqual(tensor.item(), 3)



class TestParentCounts(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self.counts = (torch.cuda.device_count(), torch.accelerator.device_count())
        self._spawn_processes()

    def test_in_the_parent(self):
        pass

    def tearDown(self):
        super().tearDown()
        assert self.counts == (3, 3), self.counts


def test_outside_the_harness():
    assert torch.cuda.device_count() == 0
"""

EXPECTED = {
    "test_0_all_reduce": "passed",
    "test_1_fails_on_rank_1_and_leaves_state": "failed",
    "test_1b_init_fails_on_rank_1": "failed",
    "test_2_starts_fresh": "passed",
    "test_3_skips_by_exit_code": "skipped",
    "test_4_rank_0_exits_with_3": "failed",
    "test_5_hangs_on_rank_1": "failed",
    "test_6_rank_1_dies": "failed",
    "test_7_after_the_death": "passed",
    "test_8_checks_its_exit_code": "passed",
    "test_9_skip_test": "skipped",
    "test_a_the_zygote_imported_no_harness": "passed",
    "test_c0_all_reduce_on_the_class_group": "passed",
    "test_c1_fails_on_rank_1": "failed",
    "test_c2_poisoned": "skipped",
    "test_d0_a_fresh_group": "passed",
    "test_in_the_parent": "passed",
    "test_outside_the_harness": "passed",
}


def outcomes(result: pytest.RunResult) -> dict[str, str]:
    found = {}
    for line in result.outlines:
        for name in EXPECTED:
            if f"::{name} " in line or line.endswith(f"::{name}"):
                for word in ("PASSED", "FAILED", "SKIPPED"):
                    if word in line:
                        found[name] = word.lower()
    return found


CONFTEST = """
def pytest_report_header():
    from torch.testing._internal.common_distributed import TEST_SKIPS

    return "skip message of multi-gpu-2: " + TEST_SKIPS["multi-gpu-2"].message
"""


@pytest.fixture
def harness_suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_harness_suite=HARNESS_SUITE)
    pytester.makeconftest(CONFTEST)  # the installed table, read where the suite imports it
    return pytester


@pytest.mark.parametrize("mode", ["serial", "xdist"])
def test_the_harness_gives_its_own_verdicts_on_gangs(harness_suite, run_pytest, mode):
    xdist = ("-n", "2", "--dist", "megatron") if mode == "xdist" else ()
    # As the controller tells a worker whose CUDA view is its home GPU: TestParentCounts.
    result = run_pytest("-v", "-rs", *xdist, timeout=240, env={RUN_DEVICE_COUNT_VAR: "3"})
    output = result.stdout.str()
    assert outcomes(result) == EXPECTED, output
    assert "Process 1 exited with error code 10" in output  # the child's own traceback
    assert "Expected exit code 0 but got 3" in output  # rank 0's code, as the parent checks it
    header = "skip message of multi-gpu-2: "
    message = next(line for line in result.outlines if line.startswith(header))[len(header) :]
    skips = [line for line in result.outlines if line.startswith("SKIPPED")]
    assert any(line.endswith(f": {message}") for line in skips), skips  # the installed table's
    assert "test_5_hangs_on_rank_1" in output and "time.sleep(600)" in output  # the hung stack
    assert "SIGKILL" in output or "signal 9" in output  # the death, named
    assert "tests that spawned: 1 check their exit codes" in output or mode == "xdist"
    assert "Previous test failed, skipping" in output  # the class's poison pill
    assert "timed out after 60 s" not in output  # no gang's cleanup hung (test_1b's group name)
    counts = "MultiProcContinuousTest 4 tests, MultiProcessTestCase 13 tests"
    assert f"spawn harnesses on gangs: {counts}" in output  # the run report, under xdist too
    if mode == "serial":
        assert "PyTorch MultiProcessTestCase: 17 tests on gangs" in output


def test_off_leaves_the_harness_alone(harness_suite, run_pytest):
    """--megatron-harnesses off: the tests spawn as without the plugin, which starts nothing."""
    harness_suite.makepyfile(
        test_harness_suite=HARNESS_SUITE.replace("class TestOnGangs", "class TestSpawned").split(
            "    def test_1_"
        )[0]
    )
    result = run_pytest("-v", "--megatron-harnesses", "off")
    result.assert_outcomes(passed=1)
    assert "xdist-megatron:" not in result.stdout.str()
    assert "run report" not in result.stdout.str()
