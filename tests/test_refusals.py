"""docs/failures.md's "Refusals" table is `tools/refusals.py`'s list, and the list is the code's:
each row's message part is in the module it names, each row's test exists in its test file."""

from __future__ import annotations

import ast
from pathlib import Path

from tools.refusals import BEGIN, END, REFUSALS, markdown, replace_table

ROOT = Path(__file__).resolve().parent.parent


def test_readme_table_is_the_list() -> None:
    text = (ROOT / "docs" / "failures.md").read_text()
    assert BEGIN in text and END in text
    assert text.split(BEGIN, 1)[1].split(END, 1)[0] == "\n" + markdown()
    assert replace_table(text) == text


def test_each_refusal_is_raised_where_it_says_and_tested() -> None:
    """The message part is a literal of the module (an f-string's fixed text counts), and the
    test is a function of the test file; a row left behind by a change of either fails."""
    problems = []
    for r in REFUSALS:
        if r.message not in (ROOT / r.module).read_text():
            problems.append(f"{r.module} has no {r.message!r}")
        file, _, name = r.test.partition("::")
        tree = ast.parse((ROOT / file).read_text())
        if name not in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}:
            problems.append(f"{file} has no {name}")
    assert problems == []


def test_the_check_finds_a_stale_row(monkeypatch) -> None:
    """A row whose message or test no longer exists is reported (the check can fail)."""
    stale = REFUSALS[0]._replace(message="no such message", test="tests/test_refusals.py::gone")
    monkeypatch.setitem(globals(), "REFUSALS", (stale,))
    try:
        test_each_refusal_is_raised_where_it_says_and_tested()
    except AssertionError as exc:
        assert "no 'no such message'" in str(exc) and "has no gone" in str(exc)
    else:
        raise AssertionError("a stale row passed")
