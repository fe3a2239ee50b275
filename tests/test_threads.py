"""Ranks share the host's cores as torchrun's do: a gang of N > 1 ranks runs one thread per rank,
a lone rank all of torch's default threads, and lone ranks side by side (xdist workers) their
share of them; OMP_NUM_THREADS set by the user wins everywhere."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

SUITE = """
import json
import os

import pytest
import torch

def record(name, rank):
    facts = {{"omp": os.environ.get("OMP_NUM_THREADS"), "threads": torch.get_num_threads()}}
    with open(os.path.join({facts!r}, f"{{name}}-{{rank}}"), "w") as f:
        json.dump(facts, f)

@pytest.mark.world_size(1)
def test_alone(rank):
    record("ws1", rank)

@pytest.mark.world_size(2)
def test_pair(rank):
    record("ws2", rank)
"""


@functools.cache
def fresh_threads(omp: str | None = None) -> int:
    """torch's thread count in a fresh process with OMP_NUM_THREADS `omp` (None: unset). Each
    asks a process that imports torch: asked once per value, as the answer cannot change."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({"OMP_NUM_THREADS": omp} if omp else {})
    command = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    return int(subprocess.run(command, env=env, capture_output=True, text=True).stdout)


@pytest.mark.parametrize("mode", ["serial", "xdist", "user"])
def test_ranks_share_the_cores(pytester, run_pytest, monkeypatch, mode):
    facts = pytester.mkdir("facts")
    pytester.makepyfile(test_threads=SUITE.format(facts=str(facts)))
    default = fresh_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if mode == "user":
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
    xdist = ["-n", "2", "--dist", "megatron"] if mode == "xdist" else []
    result = run_pytest("--megatron-devices", "cpu:4", "--megatron-timeout", "60", *xdist)
    result.assert_outcomes(passed=2)
    seen = {path.name: json.loads(path.read_text()) for path in facts.iterdir()}
    lone = {"serial": None, "xdist": str(max(1, default // 2)), "user": "3"}[mode]
    pair = "3" if mode == "user" else "1"
    assert seen["ws1-0"] == {"omp": lone, "threads": fresh_threads(lone)}
    for rank in (0, 1):
        assert seen[f"ws2-{rank}"] == {"omp": pair, "threads": fresh_threads(pair)}
