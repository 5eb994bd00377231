"""Mixtures as `mixlen plan` / `mixlen profile` / `mixlen train` take them, on small datasets:
a mixture that runs out found before the first step (and by plan, naming --steps), how
`[NAME=]DIR[@WEIGHT]` arguments read (a folder named `x@0.5`, two folders of one name), a --mix
file's relative paths and unknown keys, output folders checked before planning, and a source
path that is a file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from datapipe.errors import ConfigError
from tools.cli import main as cli

PLAN = ["--ranks", "1", "--capacity", "4096", "--global-batch-tokens", "1024", "--model",
        "debug", "--policy", "single", "--quiet"]  # fmt: skip


def _dataset(out: Path, n_docs: int, seed: int) -> str:
    import numpy as np

    from datapipe.ingest.preprocess import PreprocessConfig, preprocess

    rng = np.random.default_rng(seed)
    src = str(out) + ".jsonl"
    with open(src, "w") as f:
        for _ in range(n_docs):
            f.write(json.dumps({"text": "mixture " * int(rng.integers(2, 60))}) + "\n")
    preprocess(PreprocessConfig(inputs=[src], out=str(out), format="parquet", progress=False))
    return str(out)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mixcli")
    web = _dataset(root / "web", 40, 1)
    email = _dataset(root / "email", 30, 2)
    for name in ("a", "b"):
        (root / name).mkdir()
    shutil.copytree(web, root / "a" / "web")
    _dataset(root / "b" / "web", 25, 3)  # another dataset of the same folder name
    shutil.copytree(web, root / "solo@0.5")  # a folder whose name reads like a weight
    _dataset(root / "email@0.5", 20, 4)  # ... beside a folder of the name before the @
    return {"root": str(root), "web": web, "email": email}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _running_out(data, tmp_path: Path) -> str:
    """web stops after one pass; email has weight 0 from step 3."""
    return _write(
        tmp_path / "mix.toml",
        f'[data]\nsources = [{{path = "{data["web"]}", max_epochs = 1}}, '
        f'{{path = "{data["email"]}", max_epochs = 2}}]\n'
        "[[data.stages]]\nstart_step = 3\nweights = {email = 0}\n",
    )


def test_plan_finds_the_step_a_mixture_runs_out_naming_the_flag(data, tmp_path, capsys) -> None:
    mix = _running_out(data, tmp_path)
    code, _, err = _run(capsys, "plan", "--mix", mix, "--steps", "400", *PLAN)
    assert code == 2, err
    assert f"--mix {mix}: data: the mixture runs out of data at step " in err
    assert "every source with weight in data.stages[0] finished its passes (web " in err
    assert "(data.sources[0].max_epochs = 1)); raise max_epochs" in err
    assert "email" not in err and "train.steps" not in err
    step = int(err.split("runs out of data at step ")[1].split(":")[0])
    assert f"or lower --steps to at most {step - 1}" in err
    code, _, err = _run(capsys, "plan", "--mix", mix, "--steps", str(step - 1), *PLAN)
    assert code == 0, err


def test_train_refuses_a_mixture_that_runs_out_before_the_first_step(data, tmp_path) -> None:
    """Found from the indexes before step 1 (and by the launcher's preflight), at the step plan
    finds: nothing trained, nothing to lose."""
    from datapipe.mix.stream import DataExhausted
    from trainer.config.job import from_dict
    from trainer.train import preflight, run_training

    d = {
        "model": {"name": "debug", "dim": 32, "ffn_dim": 64},
        "data": {"sources": [{"path": data["web"], "max_epochs": 1},
                             {"path": data["email"], "max_epochs": 2}],
                 "stages": [{"start_step": 3, "weights": {"email": 0}}]},
        "train": {"steps": 400, "global_batch_tokens": 1024},
        "parallel": {"policy": "single", "capacity": 4096},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval": 0},
        "metrics": {"dir": str(tmp_path / "run"), "progress": False},
    }  # fmt: skip
    with pytest.raises(DataExhausted) as err:
        run_training(from_dict(d))
    msg = str(err.value)
    assert "lower train.steps to at most" in msg and "before step 1 was trained" in msg
    last = int(msg.split("to at most ")[1].split(" ")[0])
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()
    with pytest.raises(DataExhausted, match=f"at most {last} "):
        preflight(from_dict(d), 1)
    d["train"]["steps"] = last
    preflight(from_dict(d), 1)  # enough data for every step


def test_a_folder_named_like_a_weight_and_two_folders_of_one_name(data, capsys) -> None:
    root = data["root"]
    odd = os.path.join(root, "solo@0.5")
    code, out, err = _run(capsys, "profile", odd)  # the folder itself, one dataset
    assert code == 0 and f"profile of {odd}" in out, err
    both = os.path.join(root, "email@0.5")
    code, _, err = _run(capsys, "profile", data["email"] + "@0.5", data["web"])
    assert code == 2
    assert f"{both}: names 2 existing paths; write {data['email']}/@0.5 for " in err
    assert f"with weight 0.5; {both}@1 for {both!r}" in err
    code, out, err = _run(capsys, "profile", both + "@1", data["email"] + "/@0.5", "--json")
    assert code == 0, err
    got = json.loads(out)["sources"]
    assert [(s["name"], s["path"]) for s in got] == [
        ("email@0.5", both), ("email", data["email"] + "/")
    ]  # fmt: skip
    assert [s["weight"] for s in got] == pytest.approx([1 / 1.5, 0.5 / 1.5])
    a, b = os.path.join(root, "a", "web"), os.path.join(root, "b", "web")
    code, _, err = _run(capsys, "profile", f"{a}@1", f"{b}@2")
    assert code == 2
    assert (f"{b}@2: its name 'web' (a source is named after its path's last part) is also "
            f"{a}@1's; name them with NAME=DIR@WEIGHT, e.g. web2={b}@2") in err  # fmt: skip
    code, out, err = _run(capsys, "profile", f"web1={a}@1", f"web2={b}@2", "--json")
    assert code == 0, err
    assert [s["name"] for s in json.loads(out)["sources"]] == ["web1", "web2"]


def test_a_mix_files_paths_and_keys(data, tmp_path, capsys, monkeypatch) -> None:
    """Relative paths are read from the current folder (as `mixlen train` reads its config's),
    errors name the file's key (not DIR[0]), unknown [data] keys are refused, a mixture given both
    at the top and under [data] is refused, and a source that is a file says so."""
    sub = tmp_path / "configs"
    sub.mkdir()
    mix = _write(sub / "mix.toml", '[data]\nsources = [{path = "web"}, {path = "email"}]\n')
    monkeypatch.chdir(data["root"])
    code, out, err = _run(capsys, "profile", "--mix", mix, "--json")
    assert code == 0, err
    monkeypatch.chdir(tmp_path)
    for cmd in (["profile", "--mix", mix], ["plan", "--mix", mix, *PLAN]):
        code, _, err = _run(capsys, *cmd)
        assert code == 2
        assert (f"--mix {mix}: data.sources[0].path: dataset directory 'web' not found "
                f"(relative to the current folder {tmp_path})") in err  # fmt: skip
        assert "DIR[" not in err
    bad = _write(
        sub / "bad.toml", f'[data]\nsources = [{{path = "{data["web"]}"}}]\nlookahed = 3\n'
    )
    for cmd in (["profile", "--mix", bad], ["plan", "--mix", bad, *PLAN]):
        code, _, err = _run(capsys, *cmd)
        assert code == 2 and f"--mix {bad}: data.lookahed: unknown key (known: " in err
    both = _write(sub / "both.toml", f'sources = [{{path = "{data["web"]}"}}]\n[data]\n'
                  f'sources = [{{path = "{data["email"]}"}}]\n')  # fmt: skip
    code, _, err = _run(capsys, "plan", "--mix", both, *PLAN)  # one list was silently dropped
    assert code == 2 and f"--mix {both}: sources at the top and a [data] table: give the" in err
    config = _write(sub / "run.toml", f'[model]\nname = "debug"\n[data]\n'
                    f'sources = [{{path = "{data["web"]}"}}]\n')  # fmt: skip
    assert _run(capsys, "profile", "--mix", config)[0] == 0  # a training config's other tables
    afile = os.path.join(data["web"], "manifest.json")
    code, _, err = _run(capsys, "profile", afile + "@1", data["email"])
    assert code == 2
    assert f"{afile}@1: {afile!r} is a file, not a dataset directory" in err


def test_output_folders_are_checked_before_planning(data, tmp_path, capsys) -> None:
    missing = str(tmp_path / "nope" / "out.json")
    for flag in ("--dump", "--lengths-plot", "--plot", "--html"):
        code, _, err = _run(capsys, "plan", data["web"], data["email"], *PLAN, flag, missing)
        assert code == 2
        assert f"{flag} {missing}: its folder '{tmp_path / 'nope'}' does not exist" in err
        assert err.startswith(f"mixlen plan: error: {flag} ") and ".tmp-" not in err
    code, _, err = _run(capsys, "plan", data["web"], *PLAN, "--dump", str(tmp_path))
    assert code == 2 and f"--dump {tmp_path}: is a folder" in err
    code, _, err = _run(capsys, "profile", data["web"], "--plot", missing)
    assert code == 2 and f"--plot {missing}: its folder" in err
    ok = tmp_path / "d.json"
    code, _, err = _run(capsys, "plan", data["web"], data["email"], *PLAN, "--dump", str(ok))
    assert code == 0 and ok.exists(), err
    # an output inside a dataset the command reads (over its index, or beside it): refused, the
    # dataset's files unchanged
    index = os.path.join(data["email"], "index.parquet")
    before = {p: Path(p).read_bytes() for p in (index, os.path.join(data["web"], "manifest.json"))}
    runs = [("plan", data["web"], data["email"], *PLAN, "--dump", index),
            ("plan", data["email"], *PLAN, "--html", os.path.join(data["email"], "p.html")),
            ("profile", data["web"], "--plot", os.path.join(data["web"], "manifest.json")),
            ("profile", data["web"], data["email"], "--plot", index)]  # fmt: skip
    for argv in runs:
        code, _, err = _run(capsys, *argv)
        flag, path = argv[-2:]
        assert code == 2 and f"{flag} {path}: inside the dataset folder " in err, err
    assert {p: Path(p).read_bytes() for p in before} == before
    assert not os.path.exists(os.path.join(data["email"], "p.html"))


def test_a_file_as_a_training_source_says_so(data, tmp_path) -> None:
    from contextlib import ExitStack

    from trainer.config.job import from_dict

    afile = os.path.join(data["web"], "index.parquet")
    d = {
        "model": {"name": "debug", "dim": 32, "ffn_dim": 64},
        "data": {"sources": [{"path": data["web"]}, {"path": afile}]},
        "parallel": {"policy": "single", "capacity": 4096},
    }
    with pytest.raises(ConfigError, match=r"data.sources\[1\].path: .* is a file, not a dataset"):
        from_dict(d).train_data(0, 1, ExitStack(), validation=False)


def test_share_report_divides_a_thresholds_tokens_by_its_sources() -> None:
    """Per source: its tokens, realised and target shares, and per length_boost threshold the
    share of *its* tokens from samples whose stored length reaches it (a piece counts by its
    sample); hand counts over one batch."""
    import numpy as np

    from datapipe.mix.config import SourceConfig
    from datapipe.mix.report import share_report
    from datapipe.mix.sources import LoadedSource
    from datapipe.stream import GlobalBatch

    a_cfg = SourceConfig(path="a", length_boost={"100": 2.0})
    a = LoadedSource(a_cfg, "a", "a", None, {}, np.array([50, 150, 400]), "fa", "DIR[0]")
    b = LoadedSource(SourceConfig(path="b"), "b", "b", None, {}, np.array([10, 20]), "fb", "DIR[1]")
    units = np.array([[0, 0, 0], [0, 1, 0], [0, 2, 100], [1, 0, 0], [1, 1, 0]], np.int64)
    lengths = np.array([50, 150, 100, 10, 20], np.int64)  # a: 300 tokens, b: 30
    batch = GlobalBatch(0, 0, np.arange(5), lengths, units)
    rows = share_report([a, b], [batch], [np.array([0.25, 0.75])])
    assert [r["tokens"] for r in rows] == [300, 30]
    assert rows[0]["realised_share"] == pytest.approx(300 / 330)
    assert [r["target_share"] for r in rows] == pytest.approx([0.25, 0.75])
    assert rows[0]["above"] == [{"threshold": 100, "realised_share": pytest.approx(250 / 300)}]
    assert rows[1]["above"] == []
