"""-n auto under --dist megatron: where it starts no workers, the header says what the devices
fit, and says what the skips say."""

from __future__ import annotations

PAIRS_SUITE = """
import pytest

@pytest.mark.world_size(2)
def test_pair(rank):
    pass
"""
OPTIONS = ("-n", "auto", "--dist", "megatron", "--megatron-devices", "cpu:1", "-rs")
SKIP = "SKIPPED*needs 2 devices, 1 available*"


def test_a_world_size_the_devices_cannot_hold_fits_no_gang(pytester, run_pytest):
    """Issue 44, 2f: on cpu:1 a run whose world-size-2 tests were known from the last run said
    'the 1 device(s) fit one gang of 2 at a time' in its header, and skipped the test with
    'needs 2 devices, 1 available'. The first run knows no sizes yet: one gang of 1."""
    pytester.makepyfile(test_pairs=PAIRS_SUITE)
    first = run_pytest(*OPTIONS, cache=True)
    first.assert_outcomes(skipped=1)
    first.stdout.fnmatch_lines(["*-n auto: the 1 device(s) fit one gang of 1 at a time*", SKIP])
    second = run_pytest(*OPTIONS, cache=True)
    second.assert_outcomes(skipped=1)
    header = "*-n auto: the 1 device(s) fit no gang of 2 (those tests are skipped), so the tests"
    second.stdout.fnmatch_lines([header + "*the last run's, in the pytest cache*", SKIP])
    second.stdout.no_fnmatch_line("*fit one gang of 2*")
