"""README.md is for the plugin's users: short, every option in its table, CI's commands verbatim,
and no project history (dates, issue numbers, commit hashes: those live in git and docs/)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI_SCRIPT = ROOT / ".ci" / "run"
MAX_LINES, MAX_WIDTH = 300, 100
GROUP_TITLE = "xdist-megatron"  # the start of the plugin's `pytest --help` group title
INI_PREFIX = "megatron_"


def readme_lines() -> list[str]:
    return README.read_text().splitlines()


def section(title: str) -> str:
    """The README's `## title` section, up to the next heading of that level."""
    lines = readme_lines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end])


def help_group(help_text: str) -> tuple[set[str], set[str]]:
    """The long options of the plugin's `--help` group and the ini names starting `megatron_`."""
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(GROUP_TITLE))
    options: set[str] = set()
    for line in lines[start + 1 :]:
        if not line.strip() or not line.startswith(" "):  # a blank line ends a group
            break
        if line.startswith("  -"):  # an option's own line; its help text is indented further
            options.update(re.findall(r"--[a-z0-9][a-z0-9-]*", line.split("  ")[1]))
    inis = {m.group(1) for m in re.finditer(rf"^  ({INI_PREFIX}\w+) \(", help_text, re.M)}
    return options, inis


def test_readme_is_short_and_narrow() -> None:
    lines = readme_lines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines, at most {MAX_LINES}"
    wide = [f"{n}: {len(line)}" for n, line in enumerate(lines, 1) if len(line) > MAX_WIDTH]
    assert not wide, f"README.md lines over {MAX_WIDTH} characters (line: width): {wide}"


def test_every_option_of_the_help_group_is_in_the_options_table(
    run_pytest: Callable[..., pytest.RunResult],
) -> None:
    result = run_pytest("-p", "xdist_megatron.plugin", "--help", timeout=120)
    assert result.ret == 0, result.stderr.str()
    options, inis = help_group(result.stdout.str())
    assert len(options) >= 5 and len(inis) >= 3, (options, inis)  # the parse found the group
    table = "\n".join(line for line in section("Options").splitlines() if line.startswith("|"))
    missing = [o for o in sorted(options) if not re.search(rf"`{re.escape(o)}(?![\w-])", table)]
    missing += [i for i in sorted(inis) if f"`{i}`" not in table]
    assert not missing, f"not in README's options table: {missing}"


def test_the_ci_commands_are_in_the_readme_verbatim() -> None:
    commands = [
        line.strip()
        for line in CI_SCRIPT.read_text().splitlines()
        if re.match(r"\s*python3? -m pytest\b", line)
    ]
    assert commands, f"no pytest command found in {CI_SCRIPT}"
    readme = README.read_text()
    assert [c for c in commands if c not in readme] == []


@pytest.mark.parametrize(
    "pattern",
    [
        r"\bissues? #?\d+",  # issue numbers
        r"#\d{2,}\b",  # issue or pull request references
        r"\b20\d\d-\d\d-\d\d\b",  # dates
        r"\bsittings?\b",  # the word for a benchmark session on a lent machine
        r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b",  # commit hashes
    ],
)
def test_the_readme_holds_no_project_history(pattern: str) -> None:
    found = [
        f"{n}: {line.strip()}"
        for n, line in enumerate(readme_lines(), 1)
        if re.search(pattern, line, re.IGNORECASE)
    ]
    assert not found, f"README.md matches {pattern!r}: {found}"
