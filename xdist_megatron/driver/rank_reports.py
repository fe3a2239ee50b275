"""One pytest report per phase for a test that ran on a gang, merged from its ranks' reports.

Each rank ran the test's protocol with pytest's own runner and sent its reports serialised, as an
xdist worker does. The driver logs one report per phase: passed when every rank passed, skipped
(or xfailed) when every rank did, failed otherwise, with a `rank R` section per failing rank and
each rank's captured output. What a rank could not report itself (it died, hung, or failed the
checks after its test) joins its reports as a failure of the phase it was in.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from _pytest._code.code import ReprFileLocation, TerminalRepr
from _pytest._io import TerminalWriter

from ..protocol import DIED, FAILED, STUCK, WAITED, RankResult

PHASES = ("setup", "call", "teardown")


class RankFailuresRepr(TerminalRepr):
    """Per failing rank, what pytest shows for a local failure, headed `rank R`."""

    def __init__(self, headline: str, failures: list[tuple[int, Any]], crash: tuple[str, int]):
        self.headline = headline
        self.failures = failures
        self.reprcrash = ReprFileLocation(crash[0], crash[1], headline)

    def toterminal(self, tw: TerminalWriter) -> None:
        tw.line(self.headline, red=True, bold=True)
        for rank, longrepr in self.failures:
            tw.sep("-", f"rank {rank}", red=True)
            if hasattr(longrepr, "toterminal"):
                longrepr.toterminal(tw)
            else:
                for line in str(longrepr).splitlines():
                    tw.line(line)


def merge(item: pytest.Item, results: list[RankResult]) -> list[pytest.TestReport]:
    """The reports the driver logs for `item`, one per phase the ranks reached."""
    config = item.config
    per_rank: dict[int, dict[str, pytest.TestReport]] = {}
    for result in results:
        loaded = (
            config.hook.pytest_report_from_serializable(config=config, data=d)
            for d in result.reports
        )
        per_rank[result.rank] = {report.when: report for report in loaded}
    # Which rank's failure to name first: a rank that died caused its peers' errors; a rank that
    # was still running when the others stopped is the effect (one that was done and waited for
    # it is not: its own failure stands, and came first).
    order = {r.rank: 0 if r.lost == DIED else 2 if r.lost == STUCK else 1 for r in results}
    for result in results:
        if result.outcome == FAILED and result.lost != WAITED:
            _add_rank_failure(item, result, per_rank[result.rank])
    for result in results:
        _add_output(result, per_rank[result.rank])
    merged: list[pytest.TestReport] = []
    for when in PHASES:
        phase = {rank: reports[when] for rank, reports in per_rank.items() if when in reports}
        if when == "call" and merged and not merged[0].passed:
            continue  # as pytest: no call after a setup that did not pass
        if phase:
            merged.append(_merge_phase(item, when, phase, order))
    if merged[-1].when != "teardown":
        merged.append(_report(item, "teardown", "passed", None))
    return merged


OUT_OF_MEMORY = "CUDA out of memory"  # in torch.OutOfMemoryError's message
SHARING_SECTION = "gangs on the device"


def add_sharing(reports: list[pytest.TestReport], sharing: dict[str, int], per_device: int) -> None:
    """A failure that ran out of GPU memory says how many gangs held its devices as it ended
    (`--megatron-gangs-per-device` above 1): the others' memory is part of the story."""
    if not sharing:
        return
    held = ", ".join(f"{name}: {count} of {per_device}" for name, count in sorted(sharing.items()))
    for report in reports:
        if report.failed and OUT_OF_MEMORY in str(report.longrepr):
            text = f"out of GPU memory; gangs holding its devices as the test ended: {held}"
            report.sections.append((SHARING_SECTION, text))


def no_gang(item: pytest.Item, why: str) -> list[pytest.TestReport]:
    """The reports of a test that failed because it had no gang to run on."""
    return [
        _report(item, "setup", "passed", None),
        _report(item, "call", "failed", why),
        _report(item, "teardown", "passed", None),
    ]


def _add_rank_failure(
    item: pytest.Item, result: RankResult, reports: dict[str, pytest.TestReport]
) -> None:
    """Put what the driver saw of a rank (death, hang, failed checks) into the phase the rank
    was in; a rank whose own report already failed gets it as a section of that report."""
    text = result.message
    if result.longrepr not in (None, result.message):
        text += f"\n{result.longrepr}"
    failed = [report for report in reports.values() if report.failed]
    if failed:  # the rank's own report says what went wrong first
        failed[-1].sections.append(("xdist-megatron", text))
        return
    if "setup" not in reports:
        when = "setup"
    elif reports["setup"].passed and "call" not in reports:
        when = "call"
    else:
        when = "teardown"
    earlier = reports.get(when)
    report = _report(item, when, "failed", text)
    report.duration = result.duration
    if earlier is not None:
        report.sections = earlier.sections
        report.duration = max(earlier.duration, result.duration)
    report.start = report.stop - report.duration
    reports[when] = report


def _add_output(result: RankResult, reports: dict[str, pytest.TestReport]) -> None:
    """What the rank wrote to its file descriptors (C++ extensions, a dying rank's last words)
    joins its call report's sections (or its last report's)."""
    if not reports:
        return
    when = "call" if "call" in reports else list(reports)[-1]
    report = reports[when]
    for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            report.sections.append((f"Captured {stream} {when}", text))


def _merge_phase(
    item: pytest.Item,
    when: str,
    phase: dict[int, pytest.TestReport],
    order: dict[int, int],
) -> pytest.TestReport:
    ranks = sorted(phase)
    first = phase[ranks[0]]
    sections = [(f"{name} (rank {r})", text) for r in ranks for name, text in phase[r].sections]
    failed = [r for r in ranks if phase[r].failed]
    kinds = {(phase[r].outcome, hasattr(phase[r], "wasxfail")) for r in ranks}
    if failed:
        failed.sort(key=lambda r: (order[r], r))  # the cause first
        longrepr: Any = _failures_repr(item, failed, phase)
        merged = _report(item, when, "failed", longrepr)
    elif len(kinds) == 1:
        merged = _report(item, when, first.outcome, first.longrepr)
        if hasattr(first, "wasxfail"):
            merged.wasxfail = first.wasxfail  # type: ignore[attr-defined]
    else:
        summary = ", ".join(f"rank {r} {_outcome_words(phase[r])}" for r in ranks)
        headline = f"ranks disagree: {summary}"
        merged = _report(item, when, "failed", RankFailuresRepr(headline, [], _location(item)))
    merged.sections = sections
    merged.duration = max(phase[r].duration for r in ranks)
    merged.start = min(phase[r].start for r in ranks)  # as a local report's, from the ranks'
    merged.stop = max(phase[r].stop for r in ranks)
    merged.keywords = first.keywords
    merged.user_properties = first.user_properties
    return merged


def _failures_repr(
    item: pytest.Item, failed: list[int], phase: dict[int, pytest.TestReport]
) -> RankFailuresRepr:
    cause = phase[failed[0]].longrepr
    crash = getattr(cause, "reprcrash", None)
    message = (crash.message if crash is not None else str(cause)).strip().splitlines()[0]
    own = f"rank {failed[0]} "
    headline = message if message.startswith(own) else f"rank {failed[0]}: {message}"
    if len(failed) > 1:
        headline += f" (ranks {', '.join(map(str, sorted(failed)))} failed)"
    location = (crash.path, crash.lineno) if crash is not None else _location(item)
    return RankFailuresRepr(headline, [(r, phase[r].longrepr) for r in failed], location)


def _location(item: pytest.Item) -> tuple[str, int]:
    path, lineno, _ = item.reportinfo()
    return str(path), (lineno or 0) + 1


def _report(item: pytest.Item, when: str, outcome: str, longrepr: Any) -> pytest.TestReport:
    """A report the driver makes, stamped now (`start` and `stop`, as pytest's runner stamps
    its own: report logs and timelines read them)."""
    report = pytest.TestReport(
        item.nodeid, item.location, {}, outcome, longrepr, when, sections=[], duration=0.0
    )
    report.start = report.stop = time.time()
    return report


def _outcome_words(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.skipped and isinstance(report.longrepr, tuple):
        return f"skipped ({report.longrepr[2].removeprefix('Skipped: ')})"
    return report.outcome
