"""Which devices this process may use: detected once per role (the xdist controller to place
its workers, a driver for its gangs), from the same inputs in every process."""

from __future__ import annotations

import os

from . import placement


def detect_devices(spec: str | None = None) -> placement.DeviceSet:
    """The devices this process may use: `spec`, or every visible GPU, or CPU slots."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return placement.parse_devices(
        spec, gpus, os.cpu_count() or 1, os.environ.get("CUDA_VISIBLE_DEVICES")
    )
