"""Merging per-rank results into one pytest outcome, with a failure section per rank."""

from __future__ import annotations

from dataclasses import dataclass

from _pytest._code.code import ReprFileLocation, TerminalRepr
from _pytest._io import TerminalWriter

from .protocol import FAILED, PASSED, SKIPPED, XFAILED, RankResult


@dataclass
class Verdict:
    """What the test as a whole did."""

    outcome: str
    message: str  # skip/xfail reason, or the one-line failure naming the ranks
    failed_ranks: list[int]


def merge(results: list[RankResult]) -> Verdict:
    """Passed when every rank passed; skipped/xfailed when all agree; failed otherwise."""
    outcomes = {r.outcome for r in results}
    if len(outcomes) == 1 and outcomes.pop() in (PASSED, SKIPPED, XFAILED):
        return Verdict(results[0].outcome, results[0].message, [])
    failed = [r for r in results if r.outcome == FAILED]
    if failed:
        ranks = [r.rank for r in failed]
        return Verdict(FAILED, f"{_rank_words(ranks)} failed: {failed[0].message}", ranks)
    summary = ", ".join(f"rank {r.rank} {_outcome_words(r)}" for r in results)
    disagreeing = [r.rank for r in results if r.outcome != results[0].outcome]
    return Verdict(FAILED, f"ranks disagree: {summary}", disagreeing)


class RankFailures(Exception):
    """Raised in the driver for a test that failed on its ranks; the report shows each rank."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.message)
        self.verdict = verdict


class RankFailuresRepr(TerminalRepr):
    """Per failing rank, what pytest shows for a local failure, headed `rank R`."""

    def __init__(
        self, verdict: Verdict, results: list[RankResult], location: tuple[str, int]
    ) -> None:
        self.verdict = verdict
        self.results = results
        path, lineno = location
        for result in results:
            if result.outcome == FAILED and result.crash is not None:
                path, lineno = result.crash
                break
        self.reprcrash = ReprFileLocation(path, lineno, verdict.message)

    def toterminal(self, tw: TerminalWriter) -> None:
        if not self.verdict.failed_ranks or self.verdict.message.startswith("ranks disagree"):
            tw.line(self.verdict.message, red=True, bold=True)
        for result in self.results:
            if result.rank not in self.verdict.failed_ranks:
                continue
            tw.sep("-", f"rank {result.rank}", red=True)
            body = result.longrepr if result.outcome == FAILED else _outcome_words(result)
            if hasattr(body, "toterminal"):
                body.toterminal(tw)
            else:
                for line in str(body or result.message).splitlines():
                    tw.line(line)


def _outcome_words(result: RankResult) -> str:
    if result.outcome in (SKIPPED, XFAILED) and result.message:
        return f"{result.outcome} ({result.message})"
    return result.outcome


def _rank_words(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def output_sections(results: list[RankResult], when: str) -> list[tuple[str, str]]:
    """Report sections `Captured stdout call (rank R)` for each rank that printed."""
    sections = []
    for result in results:
        for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
            if text:
                sections.append((f"Captured {stream} {when} (rank {result.rank})", text))
    return sections
