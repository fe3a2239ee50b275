"""Import a test module on a rank the way pytest imported it in the driver.

Same module name, same file, the driver's `sys.path`, and pytest's assertion rewriting applied to
the module so that a failing `assert` on a rank carries pytest's introspection.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    """Source loader that runs pytest's assertion rewriter over the module before compiling."""

    def source_to_code(self, data, path, *, _optimize=-1):  # type: ignore[override]
        try:
            from _pytest.assertion.rewrite import rewrite_asserts
        except Exception:  # a pytest without the rewriter: plain asserts still work
            return super().source_to_code(data, path)
        tree = ast.parse(data, filename=path)
        rewrite_asserts(tree, data, path)
        return compile(tree, path, "exec", dont_inherit=True)

    def get_code(self, fullname):  # type: ignore[override]
        # Bypass the bytecode cache: cached .pyc files hold the unrewritten code.
        source = self.get_data(self.path)
        return self.source_to_code(source, self.path)


def import_test_module(name: str, path: str, sys_path: list[str]) -> ModuleType:
    """Return the test module `name` loaded from `path`, importing it on first use."""
    sys.path[:] = sys_path
    module = sys.modules.get(name)
    if module is not None and _same_file(getattr(module, "__file__", None), path):
        return module
    parent, _, _ = name.rpartition(".")
    if parent:
        importlib.import_module(parent)
    loader = _RewritingLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot import test module {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _same_file(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
