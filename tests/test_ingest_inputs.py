"""Which files and rows a run reads: `--exclude` patterns against a pathlib reference, and text
rows whose extra columns are named like another kind's fields (a `prompt` without a
`completion`), stored as documents."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from readback import read_rows, samples_from_rows

from datapipe.ingest.inputs import find_inputs
from datapipe.ingest.preprocess import PreprocessConfig, preprocess

BOS, EOS = 256, 257  # the bytes tokenizer's
TREE = [
    "a.py",
    "b.txt",
    "c.py",
    "x/c.py",
    "x/b.txt",
    "x/y/d.py",
    "x/y/c.py",
    "x/y/z/c.py",
    "y/c.py",
    "y/x/e.py",
    "z/x/c.py",
    "build/c.py",
]


def _pathlib_reference(root: Path, include: str, excludes: tuple[str, ...]) -> list[Path]:
    """Files matching `include` (pathlib's glob) less those an exclude matches: a matched file,
    or every file under a matched directory."""
    out = {p for p in root.glob(include) if p.is_file()}
    for pattern in excludes:
        for p in root.glob(pattern):
            out -= {p} if p.is_file() else {f for f in p.rglob("*")}
    return sorted(out)


@pytest.mark.parametrize(
    "excludes",
    [
        ("x/c.py",),  # a directory part: x/c.py only, not c.py, y/c.py
        ("x/y/*.py",),
        ("x/*",),  # the directory x whole (pathlib's x/* has x/y too)
        ("x/**",),
        ("**/c.py",),
        ("**/x",),  # x, y/x and z/x whole
        ("*/x/c.py", "build/*"),
        ("c.py", "x/y/z/*"),  # a bare name matches at the top only
    ],
)
def test_excludes_match_relative_paths_as_pathlib(tmp_path: Path, excludes) -> None:
    """`find_inputs` with excludes keeps pathlib's glob of the include less pathlib's glob of
    each exclude (a matched directory excluded whole); patterns match the path relative to the
    input directory, not a file's base name."""
    for name in TREE:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    for include in ("**/*", "**/*.py"):
        want = _pathlib_reference(tmp_path, include, excludes)
        got = find_inputs([str(tmp_path)], [include], excludes)
        assert got == want, (include, excludes)
        assert 0 < len(got) < len(TREE)


TEXT_ROWS = [
    {"prompt": "a question?", "text": "a document with a prompt column"},
    {"completion": "an answer", "text": "one with a completion column"},
    {"text": "ünïcödé ✓ plain"},
]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_text_rows_with_a_prompt_or_a_completion_column_are_documents(tmp_path, kind) -> None:
    """A row with `text` and only one of `prompt`/`completion` is a text row (prompt-completion
    needs both): stored as its text framed by BOS/EOS (the bytes tokenizer, by hand), every token
    trained (no loss mask), none bad."""
    if kind == "jsonl":
        src = tmp_path / "rows.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in TEXT_ROWS))
    else:  # a prompt column (null in one row) beside the text column
        src = tmp_path / "rows.parquet"
        cols = {k: [r.get(k) for r in TEXT_ROWS[:2]] for k in ("prompt", "text")}
        pq.write_table(pa.table(cols), src)
    cfg = PreprocessConfig([str(src)], str(tmp_path / "out"), progress=False)
    res = preprocess(cfg, warn=lambda msg: None)
    m = res.manifest
    rows = TEXT_ROWS if kind == "jsonl" else TEXT_ROWS[:2]
    want = [[BOS, *r["text"].encode("utf-8"), EOS] for r in rows]
    assert m["counts"]["bad"] == 0 and m["num_samples"] == len(want)
    assert "loss_mask" not in m and m["num_loss_tokens"] == m["num_tokens"] - len(want)
    got = samples_from_rows(read_rows(res.out, m))
    assert [np.asarray(got[i]).tolist() for i in sorted(got)] == want
