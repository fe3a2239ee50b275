"""Transformer Engine's global state, reset between the tests of a gang (ranks/isolation.py):
each test here fails when the matching reset is removed. Needs TE and a GPU: skipped elsewhere
(TE installs only on the lent H200, `../shared/te/README.md`). Not yet run on a GPU with TE."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch


def transformer_engine() -> bool:
    """Whether TE is installed, without importing it here (a half-built TE raises on import)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except Exception:
        return False


pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 1 or not transformer_engine(), reason="needs a GPU and TE"
)

FP8_LEFT_ON = """
import pytest
import transformer_engine.pytorch as te

try:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager
except ImportError:
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager


@pytest.mark.world_size(1)
def test_leaves_fp8_autocast_entered(device):
    # What an fp8_autocast left by an exception before its exit leaves: FP8 on, for every
    # later module of the process.
    FP8GlobalStateManager.fp8_autocast_enter(enabled=True)
    assert FP8GlobalStateManager.is_fp8_enabled()


@pytest.mark.world_size(1)
def test_the_next_test_starts_without_fp8(device):
    assert not FP8GlobalStateManager.is_fp8_enabled()
"""

ATTENTION_BACKEND_CACHED = """
import importlib
import pytest
import transformer_engine.pytorch as te

MODULES = (
    "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention",
    "transformer_engine.pytorch.attention",
)


def backends():
    for name in MODULES:
        try:
            found = getattr(importlib.import_module(name), "_attention_backends", None)
        except ImportError:
            continue
        if isinstance(found, dict):
            return found
    pytest.skip("this TE keeps no _attention_backends cache")


@pytest.mark.world_size(1)
def test_caches_a_backend_choice(device):
    backends()["backend_selection_requires_update"] = False


@pytest.mark.world_size(1)
def test_the_next_test_chooses_again(device):
    assert backends()["backend_selection_requires_update"] is True
"""


@pytest.mark.parametrize(
    "suite", [FP8_LEFT_ON, ATTENTION_BACKEND_CACHED], ids=["fp8-state", "attention-backend"]
)
def test_transformer_engine_state_is_reset_between_tests(pytester, run_pytest, suite) -> None:
    pytester.makepyfile(test_te_state=suite)
    result = run_pytest("-rA", gpus=True)
    print(result.stdout.str())
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, outcomes


def test_what_importing_transformer_engine_does_to_cuda() -> None:
    """The zygote never touches CUDA: if importing TE initialises it, TE must be left to the
    ranks (preload's CUDA check does that). This records which it is, and the import's cost."""
    code = (
        "import time, torch; t = time.perf_counter(); import transformer_engine.pytorch; "
        "print(torch.cuda.is_initialized(), round(time.perf_counter() - t, 2))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    initialised, seconds = done.stdout.split()
    print(f"import transformer_engine.pytorch: CUDA initialised {initialised}, {seconds} s")
