"""pytest's comparison explanations for asserts that fail on a rank.

Rewritten asserts ask `_pytest.assertion.util._reprcompare` to explain a failed comparison, and
pytest sets it only while it runs a test itself. A rank has no pytest session, so without this a
failing `==` there shows `assert a == b` and none of the diff pytest shows locally. The ranks call
pytest's own `pytest_assertrepr_compare` implementation with the driver's verbosity and ini
values; `pytest_assertrepr_compare` hooks from conftest files run only in the driver.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

# The ini values pytest's explanation code reads (each pytest version reads a subset).
_INI_NAMES = ("truncation_limit_lines", "truncation_limit_chars", "assertion_text_diff_style")


@dataclass(frozen=True)
class ExplainSettings:
    """The driver's settings that shape an explanation."""

    verbosity: int = 0
    ini: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: Any) -> ExplainSettings:
        kind = getattr(config, "VERBOSITY_ASSERTIONS", None)
        verbosity = config.get_verbosity(kind) if kind else config.getoption("verbose", 0)
        ini = {}
        for name in _INI_NAMES:
            try:
                ini[name] = config.getini(name)
            except ValueError:  # not a setting of this pytest version
                pass
        return cls(int(verbosity), ini)


class _RankConfig:
    """Answers the `Config` reads pytest's explanation code makes, from the driver's settings."""

    def __init__(self, settings: ExplainSettings) -> None:
        self._settings = settings
        self.pluginmanager = SimpleNamespace(has_plugin=lambda name: False)  # plain text

    def get_verbosity(self, kind: str | None = None) -> int:
        return self._settings.verbosity

    def getini(self, name: str) -> Any:
        try:
            return self._settings.ini[name]
        except KeyError:
            raise ValueError(f"unknown ini value {name!r}") from None

    def getoption(self, name: str, default: Any = None) -> Any:
        return {"verbose": self._settings.verbosity, "assertmode": "rewrite"}.get(name, default)

    getvalue = getoption

    def get_terminal_writer(self) -> Any:
        return SimpleNamespace(_highlight=lambda source, lexer="python": source)  # plain text


@contextmanager
def explaining(settings: ExplainSettings) -> Iterator[None]:
    """Explain failed comparisons in rewritten asserts, as pytest does, for the enclosed code."""
    from _pytest import assertion
    from _pytest.assertion import truncate, util

    config = _RankConfig(settings)

    def explain(op: str, left: object, right: object) -> str | None:
        try:
            lines = assertion.pytest_assertrepr_compare(config, op, left, right)
            if lines and hasattr(truncate, "materialize_with_truncation"):
                lines = truncate.materialize_with_truncation(lines, config)
            elif lines:
                lines = truncate.truncate_if_required(lines, SimpleNamespace(config=config))
        except Exception:  # a pytest whose internals read more: fall back to the bare assert
            return None
        if not lines:
            return None
        return "\n~".join(line.replace("\n", "\\n") for line in lines).replace("%", "%%")

    saved = util._reprcompare, util._config
    util._reprcompare, util._config = explain, config
    try:
        yield
    finally:
        util._reprcompare, util._config = saved
