"""Which devices this process may use: detected once per role (the xdist controller to place
its workers, a driver for its gangs), from the same inputs in every process."""

from __future__ import annotations

import dataclasses
import os

import pytest

from . import placement


def detect_devices(spec: str | None = None) -> placement.DeviceSet:
    """The devices this process may use: `spec`, or every visible GPU, or CPU slots."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return placement.parse_devices(
        spec, gpus, os.cpu_count() or 1, os.environ.get("CUDA_VISIBLE_DEVICES")
    )


def run_devices(config: pytest.Config) -> placement.DeviceSet:
    """The run's devices as its options give them (`--megatron-devices`, gangs per device);
    a bad value is a usage error."""
    try:
        detected = detect_devices(config.getoption("megatron_devices"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    return dataclasses.replace(detected, gangs_per_device=gangs_per_device(config))


def gangs_per_device(config: pytest.Config) -> int:
    """--megatron-gangs-per-device, else ini megatron_gangs_per_device: a positive int."""
    value = config.getoption("megatron_gangs_per_device", None)
    text = str(value) if value is not None else config.getini("megatron_gangs_per_device")
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise pytest.UsageError(
            f"--megatron-gangs-per-device / megatron_gangs_per_device must be a positive int, "
            f"got {text!r}"
        )
    return count
