"""@pytest.mark.megatron layouts kept between tests, and the torchrun passthrough."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import assert_no_processes_left

pytest.importorskip("megatron.core")

LAYOUT_SUITE = """
import json, os
import pytest
import torch.distributed as dist
from megatron.core import parallel_state as ps

def record(name):
    group = ps.get_tensor_model_parallel_group()
    facts = {"test": name, "rank": dist.get_rank(), "pid": os.getpid(),
             "tp_group": dist.distributed_c10d._world.pg_names[group],
             "tp": ps.get_tensor_model_parallel_world_size(),
             "pp": ps.get_pipeline_model_parallel_world_size()}
    with open(os.path.join(os.environ["FACTS"], f"{name}-{dist.get_rank()}.json"), "w") as f:
        json.dump(facts, f)

@pytest.mark.world_size(2)
@pytest.mark.megatron(tp=2)
@pytest.mark.parametrize("i", range(3))
def test_tp2(i):
    record(f"tp2-{i}")

@pytest.mark.world_size(2)
def test_without_layout():
    assert not ps.model_parallel_is_initialized()

@pytest.mark.world_size(2)
@pytest.mark.megatron(pp=2)
def test_pp2():
    record("pp2")

@pytest.mark.world_size(2)
@pytest.mark.megatron(tp=2)
def test_tp2_again():
    record("tp2-again")
"""

NEXT_MODULE = """
import pytest
import torch.distributed as dist
from megatron.core import parallel_state as ps

@pytest.mark.world_size(2)
def test_layout_gone_at_the_module_boundary():
    assert not ps.model_parallel_is_initialized()
    assert len(dist.distributed_c10d._world.pg_map) == 1
"""


def _facts(folder) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}


def test_layout_is_kept_for_tests_of_the_same_layout(pytester, run_pytest, tmp_path, monkeypatch):
    """Consecutive tests of one layout share its process groups; another layout, a test without
    one and the next module each get the state they ask for."""
    monkeypatch.setenv("FACTS", str(tmp_path))
    pytester.makepyfile(test_a_layouts=LAYOUT_SUITE, test_b_next=NEXT_MODULE)
    run_pytest("--megatron-timeout", "60").assert_outcomes(passed=7)
    facts = _facts(tmp_path)
    for rank in (0, 1):
        kept = {facts[f"tp2-{i}-{rank}"]["tp_group"] for i in range(3)}
        assert len(kept) == 1, "one tp=2 initialisation serves the three tests"
        assert facts[f"pp2-{rank}"]["pp"] == 2 and facts[f"pp2-{rank}"]["tp"] == 1
        assert facts[f"tp2-again-{rank}"]["tp_group"] not in kept, "a layout change rebuilds"
        assert facts[f"tp2-again-{rank}"]["pid"] == facts[f"tp2-0-{rank}"]["pid"]


def test_malformed_layout_is_a_collection_error(pytester, run_pytest):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.world_size(2)
        @pytest.mark.megatron(tp=0)
        def test_bad_layout():
            pass
        """
    )
    result = run_pytest()
    result.stdout.fnmatch_lines(["*test_bad_layout*megatron tp must be a positive int*"])
    assert result.ret != 0


TORCHRUN_SUITE = """
import os
import pytest
import torch
import torch.distributed as dist
import xdist_megatron
from megatron.core import parallel_state as ps

def who():
    return xdist_megatron.rank_info().rank

@pytest.mark.world_size(2)
def test_on_both_ranks(rank, world_size, device):
    assert (rank, world_size) == (dist.get_rank(), 2)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
    dist.new_group([0, 1])

@pytest.mark.world_size(2)
def test_megatron_cleaned_between_tests():
    assert not ps.model_parallel_is_initialized()

@pytest.mark.world_size(2)
@pytest.mark.megatron(tp=2)
def test_layout_under_torchrun():
    assert ps.get_tensor_model_parallel_world_size() == 2

@pytest.mark.world_size(2)
def test_gang_fixture(gang):
    assert gang.run(who) == [0, 1]

@pytest.mark.world_size(1)
def test_other_size():
    pass
"""


def test_torchrun_passthrough(pytester, tag):
    """Under `torchrun -m pytest` marked tests run in-process on each torchrun rank; sizes that
    differ from WORLD_SIZE are skipped; no gang is started."""
    pytester.makepyfile(test_torchrun_suite=TORCHRUN_SUITE)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-rs",
        str(pytester.path),
    ]
    done = subprocess.run(command, cwd=pytester.path, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert output.count("4 passed, 1 skipped") == 2, output
    assert "needs world size 1, torchrun started 2" in output
    assert_no_processes_left(tag)
