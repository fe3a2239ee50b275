"""Merge the durations files of a CI matrix's jobs into one, printed to stdout.

Usage: python merge_durations.py COMMITTED JOB_FILE...

Each job started from a copy of COMMITTED and stored what it ran (--megatron-store-durations):
shards and world-size legs are disjoint, so for each test the one job that ran it holds a value
that differs from COMMITTED; every other job still holds the committed value.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def merge(committed: dict, jobs: list[dict]) -> dict:
    tests = dict(committed["tests"])
    for job in jobs:
        for nodeid, entry in job["tests"].items():
            if committed["tests"].get(nodeid) != entry:
                tests[nodeid] = entry
    return {"version": committed["version"], "tests": dict(sorted(tests.items()))}


def main(paths: list[str]) -> None:
    committed, *jobs = (json.loads(Path(path).read_text()) for path in paths)
    json.dump(merge(committed, jobs), sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
