"""Glue (not upstream): lets tests/unit_tests/conftest.py run without Transformer Engine.

Upstream's autouse fixture `set_env` calls `is_te_min_version("1.3")`, which compares None with a
version when Transformer Engine is absent and raises TypeError: every test would error in setup.
The conftest binds the name at import (`from megatron.core.utils import is_te_min_version`), so
this replaces that one global of that one module once pytest registers it, and megatron-core's
own calls are left alone. Without TE the answer is False, as for a TE older than asked for.
With TE installed nothing changes.
"""

import pytest

UPSTREAM_CONFTEST = "tests.unit_tests.conftest"


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
