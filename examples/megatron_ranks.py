"""Expected Megatron process groups, computed independently of megatron-core.

megatron-core numbers ranks along its `order` argument (default "tp-cp-ep-dp-pp"): the first
dimension varies fastest, so with tp=2, cp=1, dp=2, pp=2 rank 5 is (tp 1, dp 0, pp 1). A group of
kinds X is the set of ranks that differ from the caller only in the X coordinates. The tests compare
what `parallel_state` built against this arithmetic, so an off-by-one in either shows up.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

DEFAULT_ORDER = ("tp", "cp", "dp", "pp")  # "tp-cp-ep-dp-pp" with ep=1: ep has no extent here


def coordinates(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """`rank`'s index along each dimension; `sizes` lists the dimensions fastest first."""
    coords = {}
    for name, size in sizes.items():
        rank, coords[name] = divmod(rank, size)
    return coords


def ranks_sharing(rank: int, sizes: dict[str, int], *varying: str) -> list[int]:
    """The ranks that agree with `rank` on every dimension except `varying`, ascending (which is
    also the order of ranks inside a Megatron group: rank within group = index in this list)."""
    world_size = 1
    for size in sizes.values():
        world_size *= size
    mine = coordinates(rank, sizes)
    fixed = [name for name in sizes if name not in varying]
    return [
        other
        for other in range(world_size)
        if all(coordinates(other, sizes)[name] == mine[name] for name in fixed)
    ]


class Layout(NamedTuple):
    """A model-parallel layout of a gang; data parallelism takes the ranks left over."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DEFAULT_ORDER}

    def group(self, rank: int, *varying: str) -> list[int]:
        return ranks_sharing(rank, self.sizes, *varying)

    def param(self) -> object:
        """This layout as a test parameter that carries its gang size and Megatron layout."""
        name = f"ws{self.world_size}-" + "-".join(f"{k}{v}" for k, v in self.sizes.items())
        marks = [
            pytest.mark.world_size(self.world_size),
            pytest.mark.megatron(tp=self.tp, pp=self.pp, cp=self.cp),
        ]
        return pytest.param(self, id=name, marks=marks)
