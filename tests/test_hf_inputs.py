"""Hugging Face exports as inputs: `datasets` save_to_disk folders and parquet exports (written here
by `datasets` itself, a test-only dependency; mixlen reads them with pyarrow), and saved tokenizer
folders (`--tokenizer-from`, written by transformers' `save_pretrained`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from readback import read_rows, samples_from_rows
from test_ingest import check_dataset, ref_tokens

from datapipe.errors import InputError
from datapipe.index import read_index
from datapipe.ingest.preprocess import PreprocessConfig, preprocess

ASSET = ROOT / "tests" / "assets" / "bpe-stdlib.json"
TEXTS = [f"document {i}: " + "lorem ipsum " * (i % 13) + "✓" * (i % 3) for i in range(300)]
TEXTS[7] = ""  # empty: counted, not a sample


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """`datasets` with its cache in a temp dir and no hub access; returns the module."""
    home = tmp_path_factory.mktemp("hf_home")
    saved = {k: os.environ.get(k) for k in ("HF_HOME", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_HOME=str(home), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    datasets = pytest.importorskip("datasets", reason="datasets is a test-only dependency (.[dev])")
    datasets.disable_progress_bars()
    yield datasets
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def saved(hf, tmp_path_factory) -> dict:
    """A shuffled Dataset saved in several Arrow files, its DatasetDict and a parquet export."""
    root = tmp_path_factory.mktemp("exports")
    ds = hf.Dataset.from_dict(
        {"content": TEXTS, "n": list(range(len(TEXTS))), "meta": [{"k": i} for i in range(300)]}
    )
    ds = ds.shuffle(seed=3).select(range(250))
    single = root / "single"
    ds.save_to_disk(str(single), max_shard_size="8KB")
    hf.DatasetDict({"train": ds, "validation": ds.select(range(10))}).save_to_disk(
        str(root / "dict")
    )
    ds.to_parquet(str(root / "export.parquet"))
    # the reference order and texts: datasets' own reader
    texts = hf.load_from_disk(str(single))["content"]
    return {"root": root, "single": single, "texts": texts}


def test_save_to_disk_folder_read_with_pyarrow(saved: dict, tmp_path: Path) -> None:
    single = saved["single"]
    assert len(list(single.glob("data-*.arrow"))) > 2, "several Arrow files"
    out = tmp_path / "o"
    res = preprocess(
        PreprocessConfig(
            [str(single)], str(out), text_field="content", chunk_tokens=40, progress=False
        )
    )
    texts = saved["texts"]
    kept = [i for i, t in enumerate(texts) if t]
    check_dataset(str(out), [ref_tokens(texts[i]) for i in kept], 40)
    idx = read_index(str(out), with_source=True)
    assert idx.source == [f"{single}#{i}" for i in kept]  # the dataset's row number
    c = res.manifest["counts"]
    assert (c["documents"], c["empty"], c["bad"]) == (250, len(texts) - len(kept), 0)


def test_folder_inside_a_directory_is_one_input(saved: dict, tmp_path: Path) -> None:
    """A directory walk takes a save_to_disk folder as one input (its JSON and Arrow files are not
    documents), in sorted order with the other inputs; the DatasetDict is refused with its splits."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text(json.dumps({"content": "first"}) + "\n")
    shutil.copytree(saved["single"], src / "b_saved")
    (src / "c.txt").write_text("last")
    out = tmp_path / "o"
    preprocess(PreprocessConfig([str(src)], str(out), text_field="content", progress=False))
    texts = ["first", *[t for t in saved["texts"] if t], "last"]
    idx = read_index(str(out), with_source=True)
    assert len(idx) == len(texts)
    got = samples_from_rows(read_rows(str(out), idx.manifest))
    for sid, t in enumerate(texts):
        np.testing.assert_array_equal(got[sid], ref_tokens(t))
    assert idx.source[1] == f"{src / 'b_saved'}#0" and idx.source[-1] == str(src / "c.txt")
    shutil.copytree(saved["root"] / "dict", src / "d_dict")
    with pytest.raises(
        InputError, match=r"DatasetDict with splits train, validation; .*d_dict/train"
    ):
        preprocess(PreprocessConfig([str(src)], str(tmp_path / "o2"), progress=False))


def test_dataset_dict_split_and_field_errors(saved: dict, tmp_path: Path) -> None:
    dd = saved["root"] / "dict"
    with pytest.raises(InputError, match="DatasetDict with splits train, validation"):
        preprocess(PreprocessConfig([str(dd)], str(tmp_path / "a"), progress=False))
    res = preprocess(
        PreprocessConfig(
            [str(dd / "validation")], str(tmp_path / "b"), text_field="content", progress=False
        )
    )
    assert res.manifest["counts"]["documents"] == 10
    # a missing column is named with the columns there are; a non-string column is bad per row
    with pytest.raises(
        InputError, match=r"missing text field 'text' \(columns: content, n, meta\)"
    ):
        preprocess(PreprocessConfig([str(dd / "train")], str(tmp_path / "c"), strict=True))
    with pytest.raises(InputError, match="no samples: .* 250 bad inputs .*text field 'n' is int"):
        preprocess(
            PreprocessConfig(
                [str(dd / "train")], str(tmp_path / "d"), text_field="n", progress=False
            )
        )


def test_parquet_export_equals_the_folder(saved: dict, tmp_path: Path) -> None:
    outs = []
    for name, src in (("p", saved["root"] / "export.parquet"), ("f", saved["single"])):
        outs.append(tmp_path / name)
        preprocess(
            PreprocessConfig([str(src)], str(outs[-1]), text_field="content", progress=False)
        )
    a, b = (read_index(str(o)) for o in outs)
    np.testing.assert_array_equal(a.num_tokens, b.num_tokens)
    ra = samples_from_rows(read_rows(str(outs[0]), a.manifest))
    rb = samples_from_rows(read_rows(str(outs[1]), b.manifest))
    assert all(np.array_equal(ra[i], rb[i]) for i in range(len(a)))


def test_imports_at_run_time(saved: dict, tmp_path: Path) -> None:
    """A preprocess to MDS imports no `datasets` (nothing mixlen runs needs it) and not
    mosaicml-streaming's dataset zoo (`streaming.text`'s C4 pulls in transformers' auto classes,
    `streaming.vision` torchvision: datapipe.libstreaming); the zoo still loads when it is used."""
    code = (
        "import sys; from tools.cli import main; "
        f"rc = main(['preprocess', {str(saved['single'])!r}, '--out', {str(tmp_path / 'o')!r}, "
        "'--text-field', 'content', '--quiet']); "
        "assert rc == 0; assert 'datasets' not in sys.modules; "
        "assert 'streaming.base.format.mds.writer' in sys.modules; "
        "lazy = {'transformers.models.auto', 'torchvision'} & set(sys.modules); "
        "assert not lazy, lazy; "
        "import streaming.text as t; from streaming.vision import StreamingCIFAR10; "
        "assert t.StreamingC4.__module__ == 'streaming.text.c4' and 'StreamingC4' in t.__all__; "
        "assert StreamingCIFAR10.__module__ == 'streaming.vision.cifar10'; "
        "assert 'transformers.models.auto' in sys.modules and 'torchvision' in sys.modules"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


# --- saved tokenizer folders ---------------------------------------------------------------------


def _save_tokenizer(folder: Path, **special: str) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ASSET), **special)
    tok.save_pretrained(str(folder))


def _edit(path: Path, **changes) -> None:
    conf = json.loads(path.read_text())
    conf.update(changes)
    path.write_text(json.dumps(conf))


def test_tokenizer_from_folder(saved: dict, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSET))
    vocab = tok.get_vocab()
    texts = [t for t in saved["texts"] if t][:40]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    def run(folder: Path, name: str):
        return preprocess(
            PreprocessConfig([str(src)], str(tmp_path / name), tokenizer_from=str(folder))
        )

    # standard folder: BOS and EOS named by the config frame every document
    std = tmp_path / "std"
    _save_tokenizer(std, bos_token="<s>", eos_token="</s>")
    res = run(std, "o-std")
    bos, eos = vocab["<s>"], vocab["</s>"]
    check_dataset(
        str(tmp_path / "o-std"), [np.array([bos, *tok.encode(t).ids, eos]) for t in texts], 65536
    )
    m = res.manifest
    assert (m["bos_id"], m["eos_id"]) == (bos, eos)
    assert m["tokenizer"]["kind"] == "hf-dir" and m["tokenizer"]["path"] == str(std)
    # the config decides: bos_token null -> no BOS; eos as an AddedToken dict
    nobos = tmp_path / "nobos"
    _save_tokenizer(nobos, eos_token="</s>")
    _edit(nobos / "tokenizer_config.json", bos_token=None, eos_token={"content": "</s>"})
    res = run(nobos, "o-nobos")
    assert (res.manifest["bos_id"], res.manifest["eos_id"]) == (None, eos)
    check_dataset(
        str(tmp_path / "o-nobos"), [np.array([*tok.encode(t).ids, eos]) for t in texts], 65536
    )
    # errors name the folder and what is wrong
    unknown = tmp_path / "unknown"
    _save_tokenizer(unknown, bos_token="<s>", eos_token="</s>")
    _edit(unknown / "special_tokens_map.json", eos_token="<|eot|>")  # it wins over the config
    with pytest.raises(InputError, match=r"unknown: eos_token '<\|eot\|>' .* not in"):
        run(unknown, "o-unknown")
    only_spm = tmp_path / "spm"
    only_spm.mkdir()
    (only_spm / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(InputError, match=r"spm: no tokenizer.json \(it has tokenizer.model"):
        run(only_spm, "o-spm")
    with pytest.raises(InputError, match="--tokenizer and --tokenizer-from"):
        preprocess(
            PreprocessConfig(
                [str(src)], str(tmp_path / "x"), tokenizer=str(ASSET), tokenizer_from=str(std)
            )
        )


def test_stand_ins_follow_the_librarys_layout(tmp_path: Path) -> None:
    """A `streaming` package with `text/` but no `vision/` (a fake, first on the path): only
    `streaming.text` gets a stand-in, which runs the package's own `__init__` at its first use;
    `streaming.vision` is left to the import system."""
    pkg = tmp_path / "streaming"
    (pkg / "text").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import streaming.text as text\n")
    (pkg / "text" / "__init__.py").write_text("X = 1\n")
    code = (
        "import sys, datapipe; "
        "assert 'streaming' not in sys.modules and 'streaming.vision' not in sys.modules; "
        "assert 'X' not in vars(sys.modules['streaming.text']); "
        "import streaming; assert streaming.text.X == 1 and streaming.text.__name__ == "
        "'streaming.text'"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
