"""Small helpers shared by the benchmarks: summary statistics, aligned tables, the machine header.

No heavy imports: benchmark scripts also run as child processes whose start-up is timed.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import sys
from importlib import metadata


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between ranks (numpy's default)."""
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(samples: list[float]) -> dict[str, float | int | list[float]]:
    """Median, p90, min and max of `samples`, with the samples themselves for the JSON record."""
    return {
        "n": len(samples),
        "median": statistics.median(samples),
        "p90": percentile(samples, 90),
        "min": min(samples),
        "max": max(samples),
        "samples": list(samples),
    }


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Plain-text table: first column left-aligned, the others (numbers) right-aligned."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def package_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, str | int]:
    """What the numbers depend on; read from metadata so the header imports nothing heavy."""
    return {
        "cores": os.cpu_count() or 1,
        "platform": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "megatron-core": package_version("megatron-core"),
        "load": " ".join(f"{load:.2f}" for load in os.getloadavg()),
    }


def command_line() -> str:
    return shlex.join(["python", *sys.argv])


def header_lines(title: str, info: dict[str, str | int]) -> list[str]:
    return [
        title,
        f"machine : {info['cores']} cores, {info['platform']}, Python {info['python']}, "
        f"torch {info['torch']}, megatron-core {info['megatron-core']}",
        f"load    : {info['load']} (1, 5, 15 min averages at start; other work skews timings)",
        f"command : {command_line()}",
    ]


def write_json(path: str, data: object) -> None:
    """A benchmark's numbers, for the README and for comparing runs."""
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
