"""`@pytest.mark.megatron(tp=2, pp=1, cp=1, ep=1)`: a Megatron model-parallel layout kept alive
across the tests that share it on a gang; here the marker is read and checked (at collection),
`ranks/megatron_layout.py` makes it live on a rank.

Initialising `parallel_state` creates a dozen process groups (NCCL communicators on GPUs, the
expensive part); tests of one layout that follow each other reuse them. The layout is torn down
on a layout change, at a module boundary (the reset) and with the gang after a failure.
"""

from __future__ import annotations

from typing import Any

MARKER = "megatron"
MARKER_HELP = (
    "megatron(tp=1, pp=1, cp=1, ep=1): initialise megatron.core.parallel_state with this layout "
    "before the test and keep it for the next tests of the same layout on the gang."
)
ARGUMENTS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
}

Layout = tuple[tuple[str, int], ...]


class LayoutError(ValueError):
    """A malformed megatron marker."""


def layout_of(marker: Any, test_name: str) -> Layout:
    """The marker's layout as a hashable, complete tuple (defaults 1)."""
    unknown = set(marker.kwargs) - set(ARGUMENTS)
    if marker.args or unknown:
        raise LayoutError(
            f"{test_name}: @pytest.mark.megatron takes keyword arguments tp, pp, cp, ep only"
        )
    sizes = {name: marker.kwargs.get(name, 1) for name in ARGUMENTS}
    for name, value in sizes.items():
        if type(value) is not int or value < 1:
            raise LayoutError(f"{test_name}: megatron {name} must be a positive int, got {value!r}")
    return tuple(sizes.items())


def check_fits(layout: Layout, world_size: int, test_name: str) -> None:
    """The layout must fit a gang of `size` ranks as megatron-core requires: tp*pp*cp divides
    the size, and so does ep*tp*pp (the expert layout; its tensor-parallel size is tp)."""
    sizes = dict(layout)
    model = sizes["tp"] * sizes["pp"] * sizes["cp"]
    expert = sizes["ep"] * sizes["tp"] * sizes["pp"]
    for what, product in (("tp*pp*cp", model), ("ep*tp*pp", expert)):
        if world_size % product:
            shown = ", ".join(f"{k}={v}" for k, v in layout if v != 1) or "all 1"
            raise LayoutError(
                f"{test_name}: @pytest.mark.megatron({shown}) does not fit world size "
                f"{world_size}: {what} = {product} must divide it"
            )
