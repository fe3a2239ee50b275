"""Glue (not upstream): lets tests/unit_tests/conftest.py run without Transformer Engine, and
marks the tests that must hold their GPU alone when gangs share it.

Upstream's autouse fixture `set_env` calls `is_te_min_version("1.3")`, which compares None with a
version when Transformer Engine is absent and raises TypeError: every test would error in setup.
The conftest binds the name at import (`from megatron.core.utils import is_te_min_version`), so
this replaces that one global of that one module once pytest registers it, and megatron-core's
own calls are left alone. Without TE the answer is False, as for a TE older than asked for.
With TE installed nothing changes.
"""

import pytest

UPSTREAM_CONFTEST = "tests.unit_tests.conftest"

# Tests that must not share their GPU with another gang (`--megatron-gangs-per-device` K > 1), by
# node-id prefix, and why. On one GPU, alone on the GPU is alone on the host.
EXCLUSIVE = {
    "tests/unit_tests/inference/test_data_parallel_inference_coordinator.py::TestCoordinator::": (
        "both tests start an inference coordinator on the same fixed port (46581): split over two "
        "gangs at once, the second could not bind it"
    ),
}


def te_min_version_or_false(version, check_equality=True):
    """`is_te_min_version`, but False instead of TypeError where TE is absent."""
    from megatron.core.utils import get_te_version, is_te_min_version

    if get_te_version() is None:
        return False
    return is_te_min_version(version, check_equality)


@pytest.hookimpl
def pytest_plugin_registered(plugin, manager):
    """Patch upstream's conftest as it is registered (historic hook: also sees earlier ones)."""
    if getattr(plugin, "__name__", None) == UPSTREAM_CONFTEST:
        plugin.is_te_min_version = te_min_version_or_false


def pytest_collection_modifyitems(items):
    """`exclusive_devices` on the tests of EXCLUSIVE (an unknown mark where the plugin is off)."""
    for item in items:
        if any(item.nodeid.startswith(prefix) for prefix in EXCLUSIVE):
            item.add_marker(pytest.mark.exclusive_devices)
