"""A Gantt chart of the devices over a run, as a self-contained SVG: one row per device (a row per
gang a device held at once, stacked, where gangs shared it), one bar per test on each device it
held, coloured by world size; hover a bar for the test. Written by
hand so that a CI artifact opens in any browser and the plugin needs no plotting package."""

from __future__ import annotations

import math
from html import escape

from .timeline import Span, lane_counts, lanes, makespan

WIDTH, LEFT, ROW, TOP, BOTTOM = 760, 64, 18, 28, 44
COLOURS = {None: "#b8b8b8", 1: "#4e79a7", 2: "#f28e2b", 4: "#59a14f", 8: "#e15759"}
OTHER_COLOUR = "#b07aa1"
FAILED_STROKE = "#c00000"


def svg(spans: list[Span], devices: tuple[int, ...], title: str) -> str:
    first, last = makespan(spans)
    scale = (WIDTH - LEFT - 10) / max(last - first, 1e-6)
    lane_of = lanes(spans)
    counts = lane_counts(lane_of)
    depth = {device: counts.get(device, 1) for device in devices}
    rows = [(device, lane) for device in devices for lane in range(depth[device])]
    row_of = {row: index for index, row in enumerate(rows)}
    height = TOP + ROW * len(rows) + BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="{LEFT}" y="16" font-size="13">{escape(title)}</text>',
    ]
    for (device, lane), row in row_of.items():
        label = f"device {device}" if depth[device] == 1 else f"dev {device}.{lane + 1}"
        parts.append(f'<text x="4" y="{TOP + row * ROW + 13}">{label}</text>')
    for span in spans:
        mine = [row_of[d, lane_of[span.nodeid, d]] for d in span.devices if d in depth]
        parts += [_bar(span, run, first, scale) for run in _row_runs(mine)]
    parts += _axis(last - first, scale, TOP + ROW * len(rows))
    parts += _legend(sorted({s.world_size or 0 for s in spans}), height - 10)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _row_runs(rows: list[int]) -> list[tuple[int, int]]:
    """The test's rows as runs of adjacent rows (first, count): one bar per block of devices."""
    runs: list[tuple[int, int]] = []
    for row in sorted(rows):
        if runs and runs[-1][0] + runs[-1][1] == row:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((row, 1))
    return runs


def _bar(span: Span, rows: tuple[int, int], first: float, scale: float) -> str:
    x = LEFT + (span.start - first) * scale
    width = max(span.seconds * scale, 0.5)
    colour = COLOURS.get(span.world_size, OTHER_COLOUR)
    edge = FAILED_STROKE if span.outcome == "failed" else "white"
    stroke = f' stroke="{edge}" stroke-width="1"'
    tip = f"{span.nodeid} ({span.outcome}) {span.seconds:.2f} s on {span.worker}"
    tip += f" {span.gang}" if span.gang else ""
    return (
        f'<rect x="{x:.1f}" y="{TOP + rows[0] * ROW + 2}" width="{width:.1f}" '
        f'height="{rows[1] * ROW - 4}" '
        f'fill="{colour}"{stroke}><title>{escape(tip)}</title></rect>'
    )


def _axis(seconds: float, scale: float, y: int) -> list[str]:
    step = _tick_step(seconds)
    parts = [f'<line x1="{LEFT}" y1="{y}" x2="{WIDTH - 10}" y2="{y}" stroke="black"/>']
    for index in range(int(seconds / step) + 1):
        x = LEFT + index * step * scale
        parts.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="black"/>')
        parts.append(
            f'<text x="{x:.1f}" y="{y + 15}" text-anchor="middle">{index * step:g} s</text>'
        )
    return parts


def _tick_step(seconds: float) -> float:
    """A round step giving about 8 ticks."""
    raw = max(seconds / 8, 1e-3)
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def _legend(sizes: list[int], y: int) -> list[str]:
    parts = []
    for index, world_size in enumerate(sizes):
        x = LEFT + index * 90
        colour = COLOURS.get(world_size or None, OTHER_COLOUR)
        label = f"world size {world_size}" if world_size else "driver"
        parts.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{colour}"/>')
        parts.append(f'<text x="{x + 14}" y="{y}">{label}</text>')
    return parts
