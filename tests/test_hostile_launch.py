"""Launching inside a user's project: a folder with its own `tools/`, `trainer/` and `datapipe/`
packages (common in ML repositories) must not replace mixlen's. torchrun was given `--module
tools.cli`, and `python -m` puts the working directory first on sys.path, so every rank ran the
folder's `tools/cli.py`. The ranks now run `tools.launch.rank_command` (safe-path mode, mixlen's
own folder first), and the documented multi-node command starts the `mixlen` console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.launch import PACKAGES_ROOT, rank_command

ROOT = Path(__file__).resolve().parent.parent
MIXLEN = Path(sys.executable).with_name("mixlen")  # the console script `pip install -e .` wrote
SHADOWED = 97  # what a shadowing package exits with


def shadow_project(folder: Path) -> Path:
    """A project folder whose `tools`, `trainer` and `datapipe` packages fail loudly on import."""
    for name in ("tools", "trainer", "datapipe"):
        pkg = folder / name
        pkg.mkdir(parents=True)
        loud = (
            "import sys\n"
            f"sys.stderr.write('SHADOWED: the working directory\\'s {name} was imported\\n')\n"
            f"raise SystemExit({SHADOWED})\n"
        )
        (pkg / "__init__.py").write_text(loud)
        if name == "tools":
            (pkg / "cli.py").write_text(loud)
    return folder


def _env() -> dict[str, str]:
    """This environment without a PYTHONPATH naming the repository (the installed package is
    what a user has; a PYTHONPATH entry would hide what sys.path does)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_a_rank_command_imports_mixlen_not_the_working_directorys(tmp_path) -> None:
    """What each rank runs (`rank_command`), run in a shadowing folder: mixlen's `tools.cli`
    answers (its usage, exit 2), never the folder's package (exit 97); -P is on, and the
    console script of the documented multi-node command is not shadowed either."""
    cwd = shadow_project(tmp_path / "project")
    probe = rank_command([])
    assert probe[:2] == [sys.executable, "-P"]
    proc = subprocess.run(probe, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage: mixlen" in proc.stdout, proc.stderr[-2000:]
    assert "SHADOWED" not in proc.stderr
    # where the rank's packages came from: mixlen's folder, first on its sys.path
    where = [*probe[:-1], probe[-1].replace(
        "from tools.cli import main; sys.exit(main())",
        "import json, tools, trainer, datapipe; print(json.dumps([sys.path[0], sys.flags.safe_path,"
        " [m.__file__ for m in (tools, trainer, datapipe)]]))",
    )]  # fmt: skip
    out = subprocess.run(where, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=60)
    first, safe, files = json.loads(out.stdout)
    assert first == PACKAGES_ROOT == str(ROOT) and safe
    assert all(f.startswith(str(ROOT) + os.sep) for f in files), files
    assert MIXLEN.is_file(), f"{MIXLEN}: the console script is missing (pip install -e .)"
    script = subprocess.run([str(MIXLEN)], cwd=cwd, env=_env(), capture_output=True, text=True)
    assert script.returncode == 2 and "SHADOWED" not in script.stderr, script.stderr[-2000:]


def test_launch_hands_torchrun_the_rank_command(monkeypatch) -> None:
    """`launch` gives torchrun `--no-python` and the rank command (no `--module tools.cli`)."""
    import torch.distributed.run as torchrun

    from tools.launch import launch

    seen = {}

    def run(args) -> None:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", "probe"
        seen["config"] = torchrun.config_from_args(args)

    monkeypatch.setattr(torchrun, "run", run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # launch sets it for the ranks; restored after
    assert launch(["train", "x.toml"], 2) == 0
    _, cmd, cmd_args = seen["config"]
    assert [cmd, *cmd_args] == rank_command(["train", "x.toml"])
    # a MIXLEN_DIST_TIMEOUT no rank could use: refused here, naming it, before torchrun starts
    from datapipe.errors import ConfigError

    for bad in ("abc", "nan", "inf", "-5", "0"):
        seen.clear()
        monkeypatch.setenv("MIXLEN_DIST_TIMEOUT", bad)
        with pytest.raises(ConfigError, match=f"MIXLEN_DIST_TIMEOUT='{bad}': expected a number"):
            launch(["train", "x.toml"], 2)
        assert not seen
    monkeypatch.setenv("MIXLEN_DIST_TIMEOUT", "2.5")
    assert launch(["train", "x.toml"], 2) == 0 and seen


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_train_nproc_2_in_a_project_with_its_own_tools_package(tmp_path) -> None:
    """`mixlen train CFG --nproc 2` run from a folder holding `tools/cli.py`, `trainer/` and
    `datapipe/` packages that exit 97 when imported: both ranks train mixlen's model (one record
    per step with both ranks' compute times, rank 0's summary logged), and nothing of the folder
    is imported; `--set` reaches the ranks through torchrun. The one test of the console script
    under --nproc (tests/test_faults_slow.py launches `python -m tools.cli`)."""
    from _train_worker import make_dataset, train_config

    from trainer.config.toml import to_toml

    data = make_dataset(str(tmp_path / "ds"), n_docs=40, fmt="parquet")  # ranks skip streaming
    run = tmp_path / "run"
    cfg = tmp_path / "c.toml"
    c = train_config(
        data, str(run), checkpoint={"dir": None}, train={"steps": 5, "eval_interval": 1}
    )
    cfg.write_text(to_toml(c))
    cwd = shadow_project(tmp_path / "project")
    sets = ["--set", "train.steps=2", "--set", "train.eval_interval=0"]  # passed to the ranks
    proc = subprocess.run(
        [str(MIXLEN), "train", str(cfg), "--nproc", "2", *sets],
        cwd=cwd,
        env={**_env(), "MIXLEN_DIST_TIMEOUT": "60"},
        capture_output=True,
        text=True,
        timeout=170,
        start_new_session=True,
    )
    assert proc.returncode == 0 and "SHADOWED" not in proc.stderr, proc.stderr[-3000:]
    recs = [json.loads(x) for x in open(run / "metrics.jsonl")]
    assert [r["step"] for r in recs] == [1, 2]
    assert all(len(r["compute_time_s_per_rank"]) == 2 for r in recs)
    # each rank's planned time beside its measured one: the step's planned imbalance is theirs,
    # and balance.md's planned column their sum over the steps
    planned = [r["planned_time_s_per_rank"] for r in recs]
    assert all(len(p) == 2 and min(p) > 0 for p in planned)
    for r, p in zip(recs, planned):
        assert r["imbalance_planned"] == pytest.approx(max(p) / (sum(p) / 2), rel=1e-12)
    rows = [x.split("|") for x in (run / "balance.md").read_text().splitlines()]
    table = [float(x[4]) for x in rows if len(x) > 5 and x[1].strip() in ("0", "1")]
    assert table == pytest.approx([sum(p[i] for p in planned) for i in (0, 1)], abs=1.1e-3)
    assert "metrics:" in proc.stderr  # rank 0's summary, logged (trainer.logs: stderr)
