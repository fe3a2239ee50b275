"""Persistent torchrun-style rank gangs for distributed PyTorch tests under pytest and xdist."""

from .driver.gang import Gang, GangError
from .protocol import RankInfo
from .ranks.rank import rank_info

__version__ = "0.1.0"
__all__ = ["Gang", "GangError", "RankInfo", "rank_info", "__version__"]
