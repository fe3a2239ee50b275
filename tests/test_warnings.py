"""The warnings summary of a run on gangs holds what the same run shows without the plugin, as
torchrun's rank 0 shows it: the warnings the conftest files and the test modules raise at import
(the driver imports them, within pytest's capture), and those a test raises on its ranks, each
as often as a rank raised it. torch.jit.script warns once for every function it compiles, from
the same line of torch's: a test that first imports megatron.core showed 1 of them, not 13."""

from __future__ import annotations

import pytest

NO_PLUGIN = ("-p", "no:xdist_megatron.plugin")
NOISY = """
import warnings

for _ in range(3):  # as torch.jit.script warns, once per function, from one line
    warnings.warn("{name} is deprecated", DeprecationWarning)
"""
INI = """
[pytest]
pythonpath = lib
markers =
    world_size(n): registered for the run without the plugin
"""
CONFTEST = "import torch  # noqa: F401\nimport noisy_conftest  # noqa: F401\n"
TESTS = """
import pytest

import noisy_module  # noqa: F401


@pytest.mark.world_size(2)
def test_on_gang():
    import noisy_body  # noqa: F401


def test_local():
    pass
"""


def summary(result: pytest.RunResult) -> list[str]:
    """The warnings summary's lines and the count in the last line."""
    lines = result.outlines
    start = next(i for i, line in enumerate(lines) if "warnings summary" in line)
    end = next(i for i, line in enumerate(lines) if line.startswith("-- Docs"))
    return [*lines[start:end], result.parseoutcomes()["warnings"]]


def test_the_warnings_summary_is_the_one_without_the_plugin(pytester, run_pytest):
    pytester.makeini(INI)
    lib = pytester.mkdir("lib")
    for name in ("noisy_conftest", "noisy_module", "noisy_body"):
        (lib / f"{name}.py").write_text(NOISY.format(name=name))
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_noisy=TESTS)
    without = run_pytest(*NO_PLUGIN)
    without.assert_outcomes(passed=2, warnings=9)
    on_gangs = run_pytest("--megatron-timeout", "60")
    on_gangs.assert_outcomes(passed=2)
    assert summary(on_gangs) == summary(without)
