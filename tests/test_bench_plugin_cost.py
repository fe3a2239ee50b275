"""bench/plugin_cost.py runs in its quickest mode on one device (`cpu:1`, as on a 1-GPU machine),
says what it left out, and leaves no process behind (as tests/test_bench.py does for the others)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_no_processes_left, start_from_a_plain_shell

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "plugin_cost.py"


def test_plugin_cost_fits_one_device(monkeypatch: pytest.MonkeyPatch, tag: str, tmp_path) -> None:
    start_from_a_plain_shell(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    command = [sys.executable, str(SCRIPT), "--repeats", "1", "--cycles", "1"]
    done = subprocess.run(
        [*command, "--devices", "cpu:1", "--json", str(tmp_path / "cost.json")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, output
    for words in (
        "left out: world_size(2): needs 2 devices, 1 available (cpu:1)",
        "conftest imports torch",
        "difference ms",
        "import xdist_megatron.plugin after pytest:",
        "one world_size(1) test each",
        "this package",
    ):
        assert words in done.stdout, f"{words!r} not in the report\n{output}"
    assert (tmp_path / "cost.json").exists()
    assert_no_processes_left(tag)
