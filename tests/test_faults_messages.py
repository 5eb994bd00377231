"""Errors a user sees name what the user wrote (a file, a row, a flag, a key), never an internal
field, and arrive as one message with exit code 2, not a traceback: config files, --set
overrides, and data faults met while training."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from _faults import flip_byte
from _train_worker import make_dataset, train_config

from datapipe.errors import ConfigError
from tools.cli import main as cli_main
from trainer.config.toml import load_config, to_toml

ROOT = Path(__file__).resolve().parent.parent
INTERNAL = re.compile(r"\bnum_ranks\b|\bnum_islands\b|\bstream\.\w|\bfetch\.\w|\bmds_access\b")


def test_error_messages_name_no_internal_fields() -> None:
    """Every `raise` in datapipe/, trainer/, tools/: no literal part of its message names an
    internal field (`num_ranks`, `stream.path`, ...); names go through datapipe.settings.Names."""
    found = []
    for pkg in ("datapipe", "trainer", "tools"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Raise) or node.exc is None:
                    continue
                mapped = set()  # arguments of names(...) / key(...) / k(...): looked up, not shown
                for sub in ast.walk(node.exc):
                    if isinstance(sub, ast.Call):
                        f = sub.func
                        name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
                        if name in ("k", "key", "names", "off"):
                            mapped.update(id(a) for a in sub.args)
                for sub in ast.walk(node.exc):
                    if (
                        isinstance(sub, ast.Constant)
                        and isinstance(sub.value, str)
                        and id(sub) not in mapped
                        and INTERNAL.search(sub.value)
                    ):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sub.value!r}")
    assert found == []


def test_config_errors_name_the_file_or_the_override(tmp_path, capsys) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('[data]\npath = "x"\n[train]\nlr = "fast"\n')
    with pytest.raises(ConfigError, match=f"^{cfg}: train.lr: expected float, got str 'fast'"):
        load_config(cfg)
    cfg.write_text('[data]\npath = "x"\n')
    with pytest.raises(ConfigError, match="^--set train.steps: must be >= 1, got 0"):
        load_config(cfg, ["train.steps=0"])
    cfg.write_text('[data]\npath = "x"\n[train]\nsteps = 0\n')
    with pytest.raises(ConfigError, match=f"^{cfg}: train.steps: must be >= 1"):
        load_config(cfg, ["train.lr=0.1"])
    cfg.write_bytes(b"\x00\xff\xfe binary")
    with pytest.raises(ConfigError, match=f"^{cfg}: not"):
        load_config(cfg)
    cfg.write_text("[train\n")
    assert cli_main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}: not valid TOML" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data") / "ds"))


def _train(dataset: str, run: Path, capsys) -> tuple[int, str]:
    cfg = run.parent / f"{run.name}.toml"
    c = train_config(dataset, str(run), parallel={"policy": "single"}, checkpoint={"dir": None})
    cfg.write_text(to_toml(c))
    rc = cli_main(["train", str(cfg), "--set", "train.steps=3", "--set", "metrics.progress=false"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_data_faults_met_while_training_name_shard_and_sample(dataset, tmp_path, capsys) -> None:
    """While training: a token id outside the vocabulary names the shard, sample and position;
    a corrupt shard names the shard; exit 2, one message."""
    import shutil

    bad = tmp_path / "oov"
    shutil.copytree(dataset, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["vocab_size"] = 100  # the data holds byte ids up to 257
    (bad / "manifest.json").write_text(json.dumps(m))
    rc, err = _train(str(bad), tmp_path / "r1", capsys)
    assert rc == 2 and re.search(
        r"shard\.\d+\.mds: sample \d+, token \d+ has id \d+, outside", err
    ), err
    flipped = tmp_path / "flipped"
    shutil.copytree(dataset, flipped)
    name = m["shards"][0]["name"]
    flip_byte(flipped / name)
    rc, err = _train(str(flipped), tmp_path / "r2", capsys)
    assert rc == 2 and f"{name}: XXH3-64 checksum" in err and err.count("error:") == 1, err
