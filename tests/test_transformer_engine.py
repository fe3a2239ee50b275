"""Transformer Engine's global state, reset between the tests of a gang (ranks/isolation.py).

Each pair of generated tests leaves one piece of TE's state changed in its first test and looks
for it in the second. Every pair runs twice: with the plugin's reset, where the second test must
pass, and with that one reset removed in the ranks (a conftest of the generated suite), where it
must fail: so each test here is seen to fail when its reset goes. Needs TE and a GPU: skipped
elsewhere (TE installs only on the lent H200, `../shared/te/README.md`)."""

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

FP8_STATE = """
import pytest
import torch

try:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager
except ImportError:  # TE before 2.8
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager


def fp8_state():
    # TE 2.8+ keeps it on an instance, older TE on the class.
    return getattr(FP8GlobalStateManager, "quantization_state", FP8GlobalStateManager)
"""

FP8_LEFT_ON = (
    FP8_STATE
    + """

@pytest.mark.world_size(1)
def test_leaves_fp8_autocast_entered(device):
    # What an autocast left by an exception before its exit leaves: FP8 on for every later
    # module of the process.
    enter = getattr(FP8GlobalStateManager, "autocast_enter", None)
    (enter or FP8GlobalStateManager.fp8_autocast_enter)(enabled=True)
    assert FP8GlobalStateManager.is_fp8_enabled()


@pytest.mark.world_size(1)
def test_the_next_test_starts_without_fp8(device):
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert fp8_state().autocast_depth == 0
"""
)

AMAX_BUFFERS = (
    FP8_STATE
    + """
import transformer_engine.pytorch as te
from transformer_engine.common import recipe


@pytest.mark.world_size(1)
def test_registers_amax_buffers(device):
    # Delayed scaling: each module's amax history joins global buffers kept for the reduction
    # at the autocast's exit; they outlive the module.
    layer = te.Linear(64, 64, device=device)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        layer(torch.randn(32, 64, device=device)).sum().backward()
    assert fp8_state().global_amax_buffer


@pytest.mark.world_size(1)
def test_the_next_test_starts_with_no_amax_buffers(device):
    state = fp8_state()
    assert not state.global_amax_buffer and not state.global_amax_history_buffer
    assert not state.autocast_arguments
"""
)

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
    # A choice made under this test's NVTE_* variables, kept for the same attention parameters.
    backends()["backend_selection_requires_update"] = False


@pytest.mark.world_size(1)
def test_the_next_test_chooses_again(device):
    assert backends()["backend_selection_requires_update"] is True
"""

TE_DISTRIBUTED = """
import pytest
import torch
import torch.distributed as dist
import transformer_engine.pytorch as te
from transformer_engine.pytorch import distributed as ted
"""

RNG_STATES_REGISTERED = (
    TE_DISTRIBUTED
    + """

class Tracker:  # what Megatron's tracker gives TE: {name: a generator state}
    def get_states(self):
        return {"model-parallel-rng": torch.cuda.get_rng_state()}

    def fork(self):
        raise AssertionError("no dropout here")


@pytest.mark.world_size(1)
def test_registers_rng_states(device):
    # Megatron's TEDotProductAttention hands TE its tracker; a later make_graphed_callables
    # without one would read these states.
    te.DotProductAttention(4, 64, get_rng_state_tracker=Tracker)
    assert ted.get_all_rng_states()


@pytest.mark.world_size(1)
def test_the_next_test_starts_with_no_rng_states(device):
    assert ted.get_all_rng_states() == {}
"""
)

RECOMPUTE_LEFT_NON_REENTRANT = (
    TE_DISTRIBUTED
    + """

@pytest.mark.world_size(1)
def test_checkpoints_non_reentrant(device):
    layer = torch.nn.Linear(16, 16, device=device)
    ted.checkpoint(layer, torch.ones(4, 16, device=device, requires_grad=True), use_reentrant=False)
    assert not ted.use_reentrant_activation_recompute()


@pytest.mark.world_size(1)
def test_the_next_test_recomputes_reentrant(device):
    assert ted.use_reentrant_activation_recompute()
"""
)

GROUP_SIZES_CACHED = (
    TE_DISTRIBUTED
    + """

@pytest.mark.world_size(1)
def test_caches_a_group_size(device):
    # Every TE module with a tp_group asks; the cache keeps the group alive after it is destroyed.
    assert ted.get_distributed_world_size(dist.new_group([0])) == 1
    assert ted.get_distributed_world_size.cache_info().currsize


@pytest.mark.world_size(1)
def test_the_next_test_starts_with_no_cached_groups(device):
    assert ted.get_distributed_world_size.cache_info().currsize == 0
"""
)

GRAPH_CAPTURE_LEFT_ON = """
import pytest
import transformer_engine.pytorch as te
from transformer_engine.pytorch import graph


@pytest.mark.world_size(1)
def test_leaves_capture_on(device):
    # What a make_graphed_callables that raised during capture leaves: every TE module and
    # attention backend choice after it believes a CUDA graph is being captured.
    graph.set_capture_start()
    assert graph.is_graph_capturing()


@pytest.mark.world_size(1)
def test_the_next_test_is_not_capturing(device):
    assert not graph.is_graph_capturing()
"""

COMPILED_CODE_KEPT = """
import pytest
import torch
import transformer_engine.pytorch as te

compiles = []


def counting_backend(graph_module, example_inputs):
    compiles.append(1)
    return graph_module.forward


double = torch.compile(lambda x: x * 2, backend=counting_backend)


@pytest.mark.world_size(1)
def test_compiles(device):
    double(torch.ones(4, device=device))
    assert len(compiles) == 1


@pytest.mark.world_size(1)
def test_the_next_test_reuses_the_compiled_code(device):
    # TE's userbuffers reset calls torch.compiler.reset(): only where a test set them up.
    double(torch.ones(4, device=device))
    assert len(compiles) == 1
"""

USERBUFFERS_LEFT = """
import pytest
import torch
from transformer_engine.pytorch.module import base

tex = base.tex  # TE's extension: importable by this name only once TE has loaded it


@pytest.mark.world_size(1)
def test_sets_userbuffers_up(device, monkeypatch):
    # One GPU: a tensor-parallel domain of one rank. Without multicast, TE asks for CUDA IPC.
    if not tex.device_supports_multicast():
        monkeypatch.setenv("UB_SKIPMC", "1")
    base.initialize_ub([128, 256], tp_size=1, dtype=torch.bfloat16)
    assert base.is_ub_initialized()


@pytest.mark.world_size(1)
def test_the_next_test_starts_without_userbuffers(device):
    # initialize_ub raises if its communicators are still there
    assert not base.is_ub_initialized() and base._ub_communicators is None
"""

# Each pair, and the statement a conftest runs in the ranks to remove its reset (to undo the
# fix, for the last): the pair must then fail.
PAIRS = {
    "fp8-autocast": (FP8_LEFT_ON, "isolation._TE_FP8_STATE_MODULES = ()"),
    "amax-buffers": (AMAX_BUFFERS, "isolation._TE_FP8_STATE_MODULES = ()"),
    "attention-backend": (ATTENTION_BACKEND_CACHED, "isolation._TE_ATTENTION_MODULES = ()"),
    "rng-states": (RNG_STATES_REGISTERED, "isolation._TE_DISTRIBUTED_MODULE = ''"),
    "recompute-flags": (RECOMPUTE_LEFT_NON_REENTRANT, "isolation._TE_DISTRIBUTED_MODULE = ''"),
    "group-size-cache": (GROUP_SIZES_CACHED, "isolation._TE_DISTRIBUTED_MODULE = ''"),
    "graph-capture": (GRAPH_CAPTURE_LEFT_ON, "isolation._TE_GRAPH_MODULE = ''"),
    "compiled-code": (
        COMPILED_CODE_KEPT,
        "isolation._userbuffers_initialised = lambda base: True",
    ),
    "userbuffers": (USERBUFFERS_LEFT, "isolation._userbuffers_initialised = lambda base: False"),
}

WITHOUT = """
import xdist_megatron.ranks.isolation as isolation

{statement}
"""


@pytest.mark.parametrize("reset", ["kept", "removed"])
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_transformer_engine_state_is_reset_between_tests(
    pytester: pytest.Pytester, run_pytest, pair: str, reset: str
) -> None:
    suite, removal = PAIRS[pair]
    pytester.makepyfile(test_te_state=suite)
    if reset == "removed":
        pytester.makeconftest(WITHOUT.format(statement=removal))
    result = run_pytest("-rA", gpus=True)
    print(result.stdout.str())
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors", 0) == 0, outcomes
    expected_failures = 1 if reset == "removed" else 0
    assert outcomes.get("failed", 0) == expected_failures, outcomes
    assert outcomes.get("passed", 0) == 2 - expected_failures, outcomes


TE_AT_IMPORT_CONFTEST = """
import sys

# Imported by each rank before its test modules: TE is here already only if the zygote had it.
FROM_ZYGOTE = "transformer_engine.pytorch" in sys.modules
"""

TE_AT_IMPORT_SUITE = """
import conftest
import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe


@pytest.mark.world_size(1)
@pytest.mark.parametrize("step", range(3))
def test_fp8_linear(device, step):
    where = "zygote" if conftest.FROM_ZYGOTE else "rank"
    print("transformer_engine.pytorch imported by the", where)
    layer = te.Linear(256, 256, device=device)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        layer(torch.randn(32, 256, device=device)).sum().backward()
"""


def test_a_suite_that_imports_transformer_engine_runs_on_gangs(
    pytester: pytest.Pytester, run_pytest
) -> None:
    """The driver imports TE when it collects the module, so the zygote follows (unless TE
    initialised CUDA at import: then each rank imports it). Either way fp8 layers run on the
    gang; the output says which, and what the first test cost."""
    pytester.makeconftest(TE_AT_IMPORT_CONFTEST)
    pytester.makepyfile(test_te_at_import=TE_AT_IMPORT_SUITE)
    result = run_pytest("-s", "-v", "--durations=0", "--megatron-timeout", "300", gpus=True)
    print(result.stdout.str())
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*transformer_engine.pytorch imported by the*"])


def test_what_importing_transformer_engine_does_to_cuda() -> None:
    """The zygote never touches CUDA: if importing TE initialises it, TE must be left to the
    ranks (preload's CUDA check does that). This records which it is, and the import's cost."""
    code = (
        "import time, torch; t = time.perf_counter(); import transformer_engine.pytorch; "
        "print(torch.cuda.is_initialized(), round(time.perf_counter() - t, 2))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    initialised, seconds = done.stdout.split()[-2:]
    print(f"import transformer_engine.pytorch: CUDA initialised {initialised}, {seconds} s")
