"""The code's shape, checked: no import cycle among mixlen's modules (every import, lazy ones
included, walked statically), `datapipe` never importing `trainer` or `tools`, the planning,
stream and index modules never importing torch, production code never importing the test support
in `trainer/testing/`, modules of at most 500 lines and functions of at
most 80 outside benchmarks, and docs/ARCHITECTURE.md's folder table naming every module there is."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("datapipe", "trainer", "tools")
LIGHT = (
    "datapipe.index",
    "datapipe.stream",
    "datapipe.settings",
    "datapipe.shapes",
    "datapipe.mix.config",
    "datapipe.mix.fill",
    "datapipe.mix.stream",
    "datapipe.mix.sources",
    "datapipe.mix.report",
)


def module_files(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `packages` under `root`."""
    out = {}
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            name = ".".join(p.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of `mods` it imports (anywhere in the file, absolute imports)."""
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:  # `from pkg import module` imports the module
                    sub = f"{node.module}.{a.name}"
                    deps.add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_planted_cycle() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    assert cycles(import_graph(module_files())) == []


def test_layering() -> None:
    graph = import_graph(module_files())
    for mod, deps in graph.items():
        if mod.startswith("datapipe"):
            assert not {d for d in deps if not d.startswith("datapipe")}, mod
        if not mod.startswith("trainer.testing"):
            assert not {d for d in deps if d.startswith("trainer.testing")}, mod


def test_planning_and_streaming_never_import_torch() -> None:
    """The planner, the stream and the index start fast: no torch, no streaming library."""
    mods = module_files()
    light = [m for m in mods if m.startswith("datapipe.plan") or m in LIGHT]
    for mod in light:
        tree = ast.parse(mods[mod].read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {n.split(".")[0] for n in names} & {"torch", "streaming"}, mod


def test_kernels_take_njit_from_datapipe_jit() -> None:
    """numba's njit (or jit) only through datapipe.jit, whose cache follows every kernel module
    (numba's own follows a kernel's file alone); each module that jits imports it as the line
    datapipe.jit looks for."""
    from datapipe.jit import IMPORT_LINE

    for mod, path in module_files().items():
        text = path.read_text()
        tree = ast.parse(text)
        froms = {
            (n.module, a.name)
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            for a in n.names
        }
        if mod != "datapipe.jit":
            assert not {("numba", "njit"), ("numba", "jit")} & froms, mod
            assert "numba.njit" not in text and "numba.jit" not in text, mod
        if ("datapipe.jit", "njit") in froms:
            assert IMPORT_LINE in text, mod


def test_sizes() -> None:
    """At most 500 lines a module and 80 a function, outside benchmarks."""
    too_long = []
    for path in sorted(ROOT.glob("**/*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in (".venv", "benchmarks", "build") or ".git" in rel.parts:
            continue
        src = path.read_text()
        if src.count("\n") > 500:
            too_long.append(f"{rel}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, "\n".join(too_long)


def folder_table(text: str) -> dict[str, set[str]]:
    """docs/ARCHITECTURE.md's folder table: folder (or module) -> the file names its row cites."""
    rows = {}
    section = text.split("### Folders", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        for where in re.findall(r"`([\w/.]+)`", cells[0]):
            rows[where] = set(re.findall(r"`([\w/.]+\.py)`", cells[2]))
    return rows


def test_architecture_folder_table_matches_the_tree() -> None:
    rows = folder_table((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    folders = {p.parent.relative_to(ROOT).as_posix() + "/" for p in module_files().values()}
    missing = sorted(f for f in folders if f not in rows)
    assert not missing, f"folders missing from docs/ARCHITECTURE.md's table: {missing}"
    for where, cited in rows.items():
        path = ROOT / where
        assert path.exists(), f"the table names {where}, which does not exist"
        if where.endswith("/"):
            files = {p.name for p in path.glob("*.py") if p.name != "__init__.py"}
            assert cited == files, (
                f"{where}: table cites {sorted(cited)}, folder has {sorted(files)}"
            )


def readme_names(text: str) -> set[str]:
    """The `.py` paths a README cites in backticks (`x.py`, `engines/base.py`, `tests/t.py`)."""
    return set(re.findall(r"`([\w/.]*\w\.py)`", text))


def readme_problems(root: Path, packages: tuple[str, ...]) -> list[str]:
    """For every README.md under `packages`: its folder's modules it does not name
    (`__init__.py` aside), and the `.py` files it names that exist neither in its folder's tree
    nor from `root`."""
    problems = []
    for readme in sorted(p for pkg in packages for p in (root / pkg).rglob("README.md")):
        folder, cited = readme.parent, readme_names(readme.read_text())
        rel = folder.relative_to(root).as_posix()
        for p in sorted(folder.glob("*.py")):
            if p.name != "__init__.py" and p.name not in cited:
                problems.append(f"{rel}/README.md does not name {p.name}")
        for name in sorted(cited):
            if not ((root / name).exists() or any(folder.rglob(name))):
                problems.append(f"{rel}/README.md names {name}, which does not exist")
    return problems


def test_folder_readmes_list_their_modules() -> None:
    """Every folder under trainer/ and datapipe/ with a README.md names each of its modules, and
    every module a README names exists (one added, renamed or removed without its README fails)."""
    problems = readme_problems(ROOT, ("trainer", "datapipe"))
    assert not problems, "\n".join(problems)


def test_readme_check_finds_a_missing_and_a_stale_module(tmp_path: Path) -> None:
    """The README check on a planted tree: backticked paths only, resolved beside the README, in
    its subfolders or from the root; a module left out and a name of no file are both reported."""
    text = "| `a.py` | see `sub/b.py`, `c.py` and `tests/t_x.py`; not d.py or `a.pyc` |"
    assert readme_names(text) == {"a.py", "sub/b.py", "c.py", "tests/t_x.py"}
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    for f in ("pkg/__init__.py", "pkg/a.py", "pkg/d.py", "pkg/sub/b.py", "pkg/sub/c.py"):
        (tmp_path / f).write_text("")
    (tmp_path / "tests" / "t_x.py").write_text("")
    (pkg / "README.md").write_text(text)
    assert readme_problems(tmp_path, ("pkg",)) == ["pkg/README.md does not name d.py"]
    (pkg / "README.md").write_text(text.replace("a.pyc", "gone.py") + " `d.py`")
    assert readme_problems(tmp_path, ("pkg",)) == [
        "pkg/README.md names gone.py, which does not exist"
    ]
