"""The users' docs hold together (issue 36, item 4): every relative link in README.md, docs/*.md
and the folder READMEs names a file of the repository (and a `#anchor` a heading of it), every
`mixlen ...` example in a shell block parses with the real command line's parser (nothing is run),
every other mention of a command (inline code, usage synopses) names a command and options it
has, `mixlen CMD --help` of every command named exits 0, every TOML example is a valid config,
and every `make TARGET` named is a target of the Makefile. One process; the commands' modules are
imported, never run."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

from tools.cli import COMMANDS, build_parser

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDER_READMES = sorted(p for d in ("trainer", "datapipe") for p in (ROOT / d).rglob("README.md"))
FENCE = re.compile(r"^[ \t]*```([\w-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
SHELL = {"sh", "bash", "console", "shell"}
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TOML = re.compile(r"^[ \t]*```toml\n(.*?)^[ \t]*```", re.M | re.S)
MAKE = re.compile(r"(?:^|[\s;&(])make\s+([A-Za-z][\w.-]*)")


def without_fences(text: str) -> str:
    """The text with its fenced code blocks blanked (their lines kept, so line numbers hold)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces to
    `-` (markup such as backticks is punctuation)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (a repeated heading's later ones get -1, -2, ...)."""
    out: set[str] = set()
    for line in without_fences(text).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            name, k = base, 0
            while name in out:
                k += 1
                name = f"{base}-{k}"
            out.add(name)
    return out


def link_problems(page: Path, root: Path) -> list[str]:
    """Relative links of `page` whose file is missing, outside `root`, or whose #anchor is not a
    heading of that file (links in code do not count)."""
    text = INLINE.sub("", without_fences(page.read_text()))
    root, page, problems = root.resolve(), page.resolve(), []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        where = f"{page.relative_to(root)}: ({target})"
        if not dest.is_relative_to(root):
            problems.append(f"{where} points outside the repository")
        elif not dest.exists():
            problems.append(f"{where} names a missing file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest.read_text())):
            problems.append(f"{where} names no heading of {dest.name}")
    return problems


def code_lines(text: str) -> list[tuple[str, bool]]:
    """Every line of code, and whether it is an example: the logical lines (backslash
    continuations joined) of shell blocks are; other blocks' lines (usage synopses) and inline
    code are mentions."""
    out = []
    for info, body in FENCE.findall(text):
        out += [(line, info in SHELL) for line in body.replace("\\\n", " ").splitlines()]
    return out + [(span, False) for span in INLINE.findall(without_fences(text))]


def commands(text: str) -> tuple[list[list[str]], list[tuple[str, list[str]]]]:
    """(the arguments after `mixlen` or `-m tools.cli` of every example, (command, its --flags)
    of every mention)."""
    examples: list[list[str]] = []
    mentions: list[tuple[str, list[str]]] = []
    for line, example in code_lines(text):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote: not a shell line
            words = line.split()
        for i, w in enumerate(words):
            if w == "mixlen" or (w == "tools.cli" and i and words[i - 1] == "-m"):
                args = words[i + 1 :]
                if args and example:
                    examples.append(args)
                elif args:
                    mentions.append((args[0], re.findall(r"--[a-z][\w-]*", " ".join(args[1:]))))
                break
    return examples, mentions


def options(command: str) -> set[str]:
    """The option strings `mixlen COMMAND` accepts (its module's parser)."""
    sub = build_parser(command)._subparsers._group_actions[0].choices[command]
    return set(sub._option_string_actions)


def mention_problems(command: str, flags: list[str]) -> list[str]:
    """A mention's command that does not exist, or flags it does not take."""
    if command not in COMMANDS:
        return [f"mixlen {command}: no such command"]
    return [f"mixlen {command} {f}: no such option" for f in flags if f not in options(command)]


def parse_problem(args: list[str]) -> str | None:
    """None when `mixlen ARGS` parses, else argparse's message (nothing runs)."""
    if args[0] not in COMMANDS:
        return f"mixlen {args[0]}: no such command"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser(args[0]).parse_args(args)
    except SystemExit as exc:
        return f"mixlen {shlex.join(args)}: exit {exc.code}: {err.getvalue().strip()[-300:]}"
    return None


def make_targets(makefile: Path) -> set[str]:
    """The rule names of a Makefile (not variable assignments)."""
    out: set[str] = set()
    for line in makefile.read_text().splitlines():
        m = re.match(r"([A-Za-z][\w. -]*?)\s*:(?![=:])", line)
        if m:
            out.update(m.group(1).split())
    return out


def make_problems(page: Path, targets: set[str]) -> list[str]:
    """`make X` in `page`'s code (inline or blocks) where X is no target."""
    text = page.read_text()
    code = [body for _, body in FENCE.findall(text)] + INLINE.findall(without_fences(text))
    named = {t for c in code for t in MAKE.findall(c)}
    return [f"{page.name}: make {t}: no such target" for t in sorted(named - targets)]


def toml_problems(page: Path) -> list[str]:
    """`page`'s TOML examples that the config classes refuse (an unknown key, a bad value). A
    `[model] pretrained` folder is left out (it would be read) and a `data.path` stands in where
    an example gives no data."""
    from trainer.config.job import from_dict

    problems = []
    for block in TOML.findall(page.read_text()):
        try:
            config = tomllib.loads(block)
            config.get("model", {}).pop("pretrained", None)
            data = config.setdefault("data", {})
            if "sources" not in data:
                data.setdefault("path", "data")
            from_dict(config)
        except ValueError as exc:  # ConfigError, InputError, a TOML syntax error
            problems.append(f"{page.name}: {exc}")
    return problems


def test_every_relative_link_resolves():
    """In README.md, docs/*.md and the folder READMEs of trainer/ and datapipe/."""
    assert len(FOLDER_READMES) > 5
    problems = [p for page in DOCS + FOLDER_READMES for p in link_problems(page, ROOT)]
    assert problems == []


def test_every_command_example_parses_and_every_command_named_has_help():
    examples: list[list[str]] = []
    mentions: list[tuple[str, list[str]]] = []
    for page in DOCS:
        e, m = commands(page.read_text())
        examples += e
        mentions += m
    readme, _ = commands((ROOT / "README.md").read_text())
    jobs = {"preprocess", "profile", "plan", "train", "export", "eval"}
    assert jobs <= {a[0] for a in readme}  # the README's examples are examples
    problems = [p for args in examples if (p := parse_problem(args))]
    problems += [p for command, flags in mentions for p in mention_problems(command, flags)]
    for name in sorted({a[0] for a in examples} | {c for c, _ in mentions} & set(COMMANDS)):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                build_parser(name).parse_args([name, "--help"])
        except SystemExit as exc:
            if exc.code != 0 or f"usage: mixlen {name}" not in out.getvalue():
                problems.append(f"mixlen {name} --help: exit {exc.code}")
        else:
            problems.append(f"mixlen {name} --help: did not exit")
    assert problems == []


def test_every_toml_example_is_a_valid_config():
    assert sum(len(TOML.findall(p.read_text())) for p in DOCS) >= 5
    assert [p for page in DOCS for p in toml_problems(page)] == []


def test_every_make_target_named_exists():
    targets = make_targets(ROOT / "Makefile")
    assert {"demo", "test"} <= targets
    assert [p for page in DOCS for p in make_problems(page, targets)] == []


def test_the_checks_find_planted_mistakes(tmp_path):
    """A broken link, a missing anchor, a link out of the tree, a misspelt flag (in an example,
    a synopsis and inline code), a missing argument, an unknown command and an unknown make
    target are each reported; what is right passes."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Two `words`: here\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n\n[ok](docs/a.md#two-words-here) [self](#top) [gone](docs/b.md) "
        "[bad anchor](docs/a.md#three) [out](../x.md) `[code](nowhere.md)` [two\nlines](c.md)\n\n"
        "```sh\nmixlen profile data --capacty 8192\nmixlen plan data --ranks 2  # a comment\n"
        "mixlen profile data --cap 8192\n"
        "mixlen trian x.toml\ntorchrun --nnodes 2 -m tools.cli train \\\n    x.toml --nproc 2\n"
        "make demo && make tset\n```\n\n"
        "```\nmixlen profile DIR [--plto FILE.png]\n```\n\n"
        "```toml\n[data]\npath = 'd'\n[[data.stages]]\nstart_step = 1\n"
        "max_sample_token = 8\n```\n\n"
        "```toml\n[model]\npretrained = 'm'\nrope_theta = -1.0\n```\n\n"
        "Inline: `mixlen plan d --ranks 2 --capacity 8 --global-batch-tokens 64 --stesp 2`, "
        "`mixlen eval ...`, `mixlen train --print-config`.\n"
    )
    assert link_problems(page, tmp_path) == [
        "README.md: (docs/b.md) names a missing file",
        "README.md: (docs/a.md#three) names no heading of a.md",
        "README.md: (../x.md) points outside the repository",
        "README.md: (c.md) names a missing file",
    ]
    examples, mentions = commands(page.read_text())
    problems = [parse_problem(a) for a in examples]
    assert len(problems) == 5 and problems[4] is None, problems  # the torchrun line parses
    assert "unrecognized arguments: --capacty" in problems[0]
    assert "the following arguments are required: --capacity" in problems[1]
    assert "unrecognized arguments: --cap 8192" in problems[2]  # no prefixes of flags
    assert problems[3] == "mixlen trian: no such command"
    assert [p for c, f in mentions for p in mention_problems(c, f)] == [
        "mixlen profile --plto: no such option",
        "mixlen plan --stesp: no such option",
    ]
    assert [c for c, _ in mentions] == ["profile", "plan", "eval", "train"]
    got = toml_problems(page)
    assert len(got) == 2 and "README.md: data.stages[0].max_sample_token: unknown key" in got[0]
    assert got[1].startswith("README.md: model.rope_theta: ") and "-1.0" in got[1]
    assert make_problems(page, make_targets(ROOT / "Makefile")) == [
        "README.md: make tset: no such target"
    ]
