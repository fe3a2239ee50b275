"""Persistent torchrun-style rank gangs for distributed PyTorch tests under pytest and xdist.

The public names are imported on first use: pytest imports this package in every run of an
environment that has the plugin installed (`plugin.py` is its entry point), and a run that uses
none of it must not pay for the driver's and the ranks' modules.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Gang", "GangError", "RankInfo", "rank_info", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Gang", "GangError"):
        from .driver import gang as home
    elif name == "RankInfo":
        from . import protocol as home
    elif name == "rank_info":
        from .ranks import rank as home
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(home, name)  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
