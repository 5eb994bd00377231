"""Mixtures on real datasets: config refusals naming the key, the fetch of units against the
sources' own tokens, tokens_by_source against an independent count, a training run resumed
mid-stage, the batches independent of the rank count, and `mixlen profile` / `mixlen plan`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from datapipe.errors import ConfigError
from datapipe.plan.loss import IGNORE_INDEX
from trainer.config.job import from_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BPE = os.path.join(REPO, "tests", "assets", "bpe-stdlib.json")


def _dataset(
    out: Path, n_docs: int, lo: int, hi: int, seed: int, tokenizer: str | None = None
) -> str:
    """A parquet dataset of `n_docs` documents of lo..hi characters (storage chunks of 64)."""
    from datapipe.ingest.preprocess import PreprocessConfig, preprocess

    rng = np.random.default_rng(seed)
    words = "alpha beta gamma delta tokens mixture stage source weight length".split()
    src = str(out) + ".jsonl"
    with open(src, "w") as f:
        for _ in range(n_docs):
            n = int(rng.integers(lo, hi))
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=n // 5 + 1))[:n]}) + "\n")
    preprocess(
        PreprocessConfig(
            inputs=[src], out=str(out), chunk_tokens=64, format="parquet", progress=False,
            tokenizer=tokenizer,
        )
    )  # fmt: skip
    return str(out)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mix")
    out = {
        "code": _dataset(root / "code", 150, 5, 300, seed=1),
        "books": _dataset(root / "books", 30, 300, 1500, seed=2),
        "books2": _dataset(root / "books2", 12, 300, 1500, seed=4),
        "bpe": _dataset(root / "bpe", 20, 10, 200, seed=3, tokenizer=BPE),
    }
    shutil.copytree(out["code"], root / "code-copy")
    out["copy"] = str(root / "code-copy")
    return out


def _cfg(data: dict[str, str], run: Path, **data_keys):
    d = {
        "model": {"name": "debug", "dim": 32, "ffn_dim": 64},
        "data": {
            "sources": [
                {"path": data["code"], "weight": 0.7},
                {"path": data["books"], "weight": 0.3, "length_boost": {"600": 2.0}},
            ],
            "stages": [{"start_step": 1, "max_sample_tokens": 256}],
            "val_fraction": 0.1,
            "val_tokens": 512,
            **data_keys,
        },
        "train": {"steps": 6, "global_batch_tokens": 1024, "lr": 3e-3, "warmup": 2},
        "parallel": {"policy": "hdp", "capacity": 256},
        "checkpoint": {"dir": str(run / "ckpt"), "interval": 3},
        "metrics": {"dir": str(run), "progress": False},
    }
    return d


BAD = [
    ({"sources": [{"path": "x", "weight": 0}]}, "data.sources: every source has weight 0"),
    ({"sources": [{"path": "x"}, {"path": "y", "weight": -1.0}]}, "data.sources[1].weight"),
    ({"sources": [{"path": "x", "weight": float("nan")}]}, "data.sources[0].weight: must be finite"),
    ({"sources": [{"path": "x", "weight": float("inf")}]}, "data.sources[0].weight: must be finite"),
    ({"sources": [{"path": "a/x"}, {"path": "b/x"}]}, "data.sources[1]: name 'x' is also source 0's"),
    ({"sources": [{"path": "x", "wieght": 1}]}, "data.sources[0].wieght: unknown key"),
    ({"sources": [{"path": "x", "length_boost": {"big": 2}}]}, "data.sources[0].length_boost.big"),
    ({"sources": [{"path": "x", "length_boost": {"100": 0}}]}, "data.sources[0].length_boost.100"),
    ({"sources": [{"path": "x"}], "stages": [{"start_step": 5}, {"start_step": 5}]},
     "data.stages[1].start_step: 5, but stages must start at increasing steps"),
    ({"sources": [{"path": "x"}], "stages": [{"start_step": 0}]}, "data.stages[0].start_step"),
    ({"sources": [{"path": "x"}], "stages": [{"start_step": 2, "max_sample_tokens": 1}]},
     "data.stages[0].max_sample_tokens: must be >= 2"),
    ({"sources": [{"path": "x"}], "stages": [{"start_step": 2, "context": 9}]},
     "data.stages[0].context: unknown key"),
    ({"sources": [{"path": "x"}], "stages": [{"start_step": 2, "weights": {"y": 1}}]},
     "data.stages[0].weights.y: no source of that name"),
    ({"sources": [{"path": "x"}], "stages": [{"start_step": 2, "weights": {"x": 0}}]},
     "data.stages[0].weights: every source has weight 0"),
    ({"sources": [{"path": "x"}], "stages": [{"start_step": 2, "weights": {"x": -1}}]},
     "data.stages[0].weights.x: must be >= 0, got -1"),
    ({"sources": [{"path": "x", "weight": 1e308}, {"path": "y", "weight": 1e308}]},
     "data.sources[0].weight: must be <= 1e+12"),
    ({"sources": [{"path": "x", "length_boost": {"100": 2, "1_00": 3}}]},
     "data.sources[0].length_boost.1_00: the token count 100 is given twice"),
    ({"path": "x", "sources": [{"path": "y"}]}, "data.path and data.sources: give one"),
    ({"sources": [{"path": "x"}], "val_path": "v"}, "data.val_path: not with data.sources"),
    ({"sources": {"path": "x"}}, "data.sources: expected an array of tables"),
]  # fmt: skip


@pytest.mark.parametrize("keys,msg", BAD)
def test_mixture_config_refusals_name_the_key(keys, msg) -> None:
    d = {"data": keys}
    with pytest.raises(ConfigError) as err:
        from_dict(d)
    assert msg in str(err.value)


def _train_data(cfg, rank: int = 0, ranks: int = 1, stack: ExitStack | None = None):
    return cfg.train_data(rank, ranks, stack or ExitStack(), validation=False)


def test_dataset_refusals_name_both_sources(data, tmp_path) -> None:
    cfg = from_dict(_cfg(data, tmp_path))
    cfg.data.sources[1].path = data["copy"]
    with pytest.raises(
        ConfigError, match=r"data.sources\[1\].path: .*same dataset as data.sources\[0\]"
    ):
        _train_data(cfg)
    cfg.data.sources[1].path = data["bpe"]
    with pytest.raises(ConfigError) as err:
        _train_data(cfg)
    msg = str(err.value)
    assert "data.sources[1].path: bpe was tokenized differently from data.sources[0] code" in msg
    assert "(vocab_size 4096 vs 258; bos_id" in msg  # bpe first: the source named first
    cfg = from_dict(_cfg(data, tmp_path, val_fraction=0.999))
    with pytest.raises(ConfigError, match="leaves source 'code' no training samples"):
        _train_data(cfg)
    cfg = from_dict(_cfg(data, tmp_path, stages=[]))  # 1,500-character books on 1 rank of 256
    with pytest.raises(Exception, match="max_sample_tokens"):
        _train_data(cfg)


def test_units_fetch_the_sources_tokens_and_tokens_by_source_counts_them(data, tmp_path) -> None:
    from datapipe.fetch import FetchConfig

    cfg = from_dict(_cfg(data, tmp_path, stages=[{"start_step": 1, "max_sample_tokens": 100}]))
    with ExitStack() as stack:
        td = _train_data(cfg, stack=stack)
        plain = [FetchConfig().build(data[n]) for n in ("code", "books")]
        for f in plain:
            stack.callback(f.close)
        whole = [{} for _ in plain]
        for _, (batch, plan, _) in zip(range(5), td.plans()):
            mbs = td.fetcher.fetch_step(td.pieces(plan, batch))
            counted = np.zeros(2, np.int64)
            for mb, m in zip(mbs, plan.microbatches(0)):
                cu = mb.cu_seqlens
                for i, (key, a, b) in enumerate(m.pieces):
                    src, sid, start = batch.units[key - batch.sample_ids[0]]
                    n = int(batch.lengths[key - batch.sample_ids[0]])
                    if sid not in whole[src]:  # the sample read whole, by the source's own fetch
                        whole[src][sid] = plain[src].fetch([(sid, 0, plain[src].lengths[sid])])
                    ref = whole[src][sid]
                    got = slice(cu[i], cu[i + 1])
                    assert np.array_equal(mb.input_ids[got], ref.input_ids[start + a : start + b])
                    assert np.array_equal(mb.position_ids[got], np.arange(a, b))  # from 0
                    labels = mb.labels[got]
                    want = ref.input_ids[start + a + 1 : start + min(b + 1, n)]
                    assert np.array_equal(labels[: len(want)], want)
                    assert (labels[len(want) :] == IGNORE_INDEX).all()
                    counted[src] += b - a
            assert td.tokens_by_source(batch) == {"code": counted[0], "books": counted[1]}
            assert batch.lengths.max() <= 100


def _losses(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_training_on_a_mixture_resumes_mid_stage_with_the_same_batches(data, tmp_path) -> None:
    from trainer.train import run_training

    stages = [
        {"start_step": 1, "max_sample_tokens": 256},
        {"start_step": 3, "max_sample_tokens": 128, "weights": {"books": 0.5}},
    ]
    d = _cfg(data, tmp_path / "a", stages=stages)
    d["train"]["eval_interval"] = 3
    straight = run_training(from_dict(d))
    d = _cfg(data, tmp_path / "b", stages=stages)
    d["train"].update(eval_interval=3, stop_after=4)
    run_training(from_dict(d))
    d["train"].pop("stop_after")
    d["checkpoint"]["resume"] = True
    d["data"]["stages"] = stages + [{"start_step": 6, "global_batch_tokens": 512}]  # changed
    resumed = run_training(from_dict(d))
    assert resumed["start_step"] == 4
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(a[:5], b[:5]):  # the same batches, the same losses up to the changed stage
        assert x["tokens_by_source"] == y["tokens_by_source"] and x["stage"] == y["stage"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6)
    assert a[-1]["stage"] == 1 and b[-1]["stage"] == 2 and b[-1]["tokens"] <= 512
    assert a[-1]["tokens"] > 512
    for r in a:
        assert sum(r["tokens_by_source"].values()) == r["tokens"]
    assert set(a[2]["val_by_source"]) == {"code", "books"} and "val_loss" in a[2]
    # books' held-out samples are longer than the 256 positions a plan holds: cut into units
    assert all(np.isfinite(v) and v > 0 for v in a[2]["val_by_source"].values())
    report = (tmp_path / "a" / "balance.md").read_text()
    assert (
        "| source | tokens | realised share | target share | of its tokens, in samples >= |"
        in report
    )
    assert "| books |" in report and "| 600: " in report
    assert straight["losses"][-1] < straight["losses"][0]
    newest = sorted((tmp_path / "b" / "ckpt").glob("step-*/run.json"))[-1]
    state = json.loads(newest.read_text())["stream"]  # the data state: each source and the stage
    assert state["step"] == 6 and state["stage"] == 2
    assert set(state["sources"]["books"]) >= {"epoch", "cursor", "deferred", "taken"}


def test_the_batches_do_not_depend_on_the_rank_count(data, tmp_path) -> None:
    cfg = from_dict(_cfg(data, tmp_path))
    with ExitStack() as stack:
        one = _train_data(cfg, 0, 1, stack)
        two = _train_data(cfg, 1, 2, stack)
        for _ in range(3):
            next(one.stream)
        two.stream.load_state_dict(json.loads(json.dumps(one.stream.state_dict())))
        assert [next(one.stream).digest() for _ in range(4)] == [
            next(two.stream).digest() for _ in range(4)
        ]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", *args], capture_output=True, text=True, cwd=REPO,
        timeout=180,
    )  # fmt: skip


@pytest.mark.timeout(240)
def test_profile_and_plan_take_a_mixture(data, tmp_path) -> None:
    mix = tmp_path / "mix.toml"
    mix.write_text(
        f'[data]\nsources = [{{path = "{data["code"]}", weight = 0.7}}, '
        f'{{path = "{data["books"]}", weight = 0.3, length_boost = {{600 = 3.0}}}}]\n'
        "[[data.stages]]\nstart_step = 1\nmax_sample_tokens = 256\n"
    )
    out = _cli(
        "plan", "--mix", str(mix), "--ranks", "2", "--capacity", "256",
        "--global-batch-tokens", "2048", "--steps", "8", "--model", "debug", "--json",
        "--lengths-plot", str(tmp_path / "lengths.png"), "--quiet",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)["mixture"]
    assert [r["name"] for r in rep] == ["code", "books"]
    assert abs(rep[0]["realised_share"] - 0.7) < 0.05 and rep[1]["above"][0]["threshold"] == 600
    assert (tmp_path / "lengths.png").stat().st_size > 0
    prof = _cli(
        "profile",
        f"{data['code']}@2",
        f"{data['books']}@1",
        "--json",
        "--plot",
        str(tmp_path / "p.png"),
    )
    assert prof.returncode == 0, prof.stderr
    got = json.loads(prof.stdout)["sources"]
    assert [p["weight"] for p in got] == pytest.approx([2 / 3, 1 / 3])
    assert got[0]["num_samples"] == 150 and (tmp_path / "p.png").exists()
    bad = _cli("profile", f"{data['code']}@-1", data["books"])
    assert bad.returncode == 2 and f"{data['code']}@-1: must be >= 0, got -1.0" in bad.stderr


def test_a_resume_on_other_sources_is_refused_naming_the_source(data, tmp_path) -> None:
    from trainer.checkpoint.checkpointer import check_run_matches

    cfg = from_dict(_cfg(data, tmp_path))
    with ExitStack() as stack:
        saved = _train_data(cfg, stack=stack).stream
        next(saved)
        ckpt = tmp_path / "step-1"
        ckpt.mkdir()
        run = {"config": cfg.to_dict(), "stream": saved.state_dict()}
        (ckpt / "run.json").write_text(json.dumps(run))
        other = from_dict(_cfg(data, tmp_path))
        other.data.sources[1].path = data["books2"]
        other.data.sources[1].name = "books"
        with pytest.raises(ConfigError, match=r"sources\[1\]: source 'books' is not the dataset"):
            check_run_matches(str(ckpt), other, _train_data(other, stack=stack).stream)
        reweighted = from_dict(_cfg(data, tmp_path))  # weights may change on resume
        reweighted.data.sources[0].weight = 0.2
        check_run_matches(str(ckpt), reweighted, _train_data(reweighted, stack=stack).stream)


def test_a_mixture_config_round_trips_through_print_config(data, tmp_path) -> None:
    from trainer.config.toml import load_config, to_toml

    d = _cfg(data, tmp_path)
    d["data"]["stages"].append(
        {"start_step": 9, "weights": {"books": 0.0}, "global_batch_tokens": 512}
    )
    cfg = from_dict(d)
    path = tmp_path / "again.toml"
    path.write_text(to_toml(cfg, comments=True))
    assert load_config(path) == cfg


def test_the_declared_context_is_checked_against_the_longest_unit(data, tmp_path) -> None:
    d = _cfg(data, tmp_path)  # units of at most 256 tokens (books hold 1,500-character samples)
    d["model"]["max_position_embeddings"] = 256
    _train_data(from_dict(d))  # the pieces fit the declared context
    d["model"]["max_position_embeddings"] = 200
    with pytest.raises(
        ConfigError,
        match=r"data.sources \(the longest unit\) holds samples of up to 256",
    ):
        _train_data(from_dict(d))


@pytest.mark.timeout(300)
def test_mixlen_eval_on_a_mixture_reports_each_source_as_training_did(
    data, tmp_path, capsys
) -> None:
    """`mixlen eval CKPT --mix FILE`: each source's held-out samples (the run's val_fraction and
    seed, per source) evaluated on their own; by_source equals the run's val_by_source at that
    step and the pooled loss its val_loss."""
    from tools.cli import main as cli_main
    from trainer.train import run_training

    d = _cfg(data, tmp_path / "run", val_tokens=1 << 20)  # the whole held-out split
    d["train"].update(steps=2, eval_interval=2)
    d["parallel"]["capacity"] = 2048  # every held-out sample fits one rank
    run_training(from_dict(d))
    last = _losses(tmp_path / "run")[-1]
    mix = tmp_path / "mix.toml"
    mix.write_text(
        f'sources = [{{path = "{data["code"]}"}}, {{path = "{data["books"]}", weight = 3}}]\n'
    )
    ckpt = str(tmp_path / "run" / "ckpt")
    assert (
        cli_main(["eval", ckpt, "--mix", str(mix), "--no-passkey", "--capacity", "2048", "--json"])
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    assert set(got["by_source"]) == {"code", "books"}
    for name, r in got["by_source"].items():
        assert r["loss"] == pytest.approx(last["val_by_source"][name], rel=1e-6)
    assert got["loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert got["tokens"] == sum(r["tokens"] for r in got["by_source"].values())
    weighted = sum(r["loss"] * r["tokens"] for r in got["by_source"].values()) / got["tokens"]
    assert got["loss"] == pytest.approx(weighted, rel=1e-9)  # pooled: the token-weighted mean
    assert cli_main(["eval", ckpt, data["code"], f"{data['books']}@1", "--no-passkey",
                     "--capacity", "2048"]) == 0  # fmt: skip
    assert "| books |" in capsys.readouterr().out
    # a source whose held-out split is empty is left out and named, as training leaves it out
    from trainer.data import held_out_mask

    frac = next(f for f in (0.01, 0.02, 0.03, 0.05) if not held_out_mask(np.arange(12), 0, f).any()
                and held_out_mask(np.arange(150), 0, f).any())  # fmt: skip
    assert cli_main(["eval", ckpt, data["code"], data["books2"], "--no-passkey", "--capacity",
                     "2048", "--val-fraction", str(frac), "--json"]) == 0  # fmt: skip
    left = json.loads(capsys.readouterr().out)
    assert left["left_out"] == ["books2"] and set(left["by_source"]) == {"code"}


def test_passkey_beyond_the_declared_context_only_when_asked() -> None:
    from trainer.eval.cli import _check_passkey_lengths

    context = 1024  # the model's declared context
    with pytest.raises(ConfigError, match="--passkey-beyond-context"):
        _check_passkey_lengths([1024, 4096], context, 2, 4096)
    _check_passkey_lengths([1024, 4096], context, 2, 4096, beyond=True)  # before an extension
    with pytest.raises(ConfigError, match="more than 2 ranks"):  # the ranks still bound it
        _check_passkey_lengths([16384], context, 2, 4096, beyond=True)


@pytest.mark.timeout(240)
def test_plan_with_the_training_config_as_mix_draws_the_training_batches(data, tmp_path) -> None:
    """`mixlen plan --mix CONFIG.toml` (the training config itself) plans the batches training
    draws: its seed, look-ahead and held-out split."""
    from trainer.config.toml import to_toml

    d = _cfg(data, tmp_path, seed=3, lookahead=5)  # val_fraction 0.1 from _cfg
    cfg = from_dict(d)
    path = tmp_path / "train.toml"
    path.write_text(to_toml(cfg))
    out = _cli("plan", "--mix", str(path), "--ranks", "1", "--capacity", "256",
               "--global-batch-tokens", "1024", "--steps", "4", "--model", "debug",
               "--policy", "single", "--dump", str(tmp_path / "dump.json"), "--quiet")  # fmt: skip
    assert out.returncode == 0, out.stderr
    planned = [
        [n for _, n in step["samples"]]
        for step in json.loads((tmp_path / "dump.json").read_text())["steps"]
    ]
    with ExitStack() as stack:
        td = _train_data(cfg, stack=stack)
        drawn = [next(td.stream).lengths.tolist() for _ in range(4)]
    assert planned == drawn


def test_resume_checks_order_and_fingerprints_and_takes_a_data_path_run_into_stages(
    data, tmp_path
) -> None:
    from trainer.checkpoint.checkpointer import check_run_matches

    def saved(cfg, stream, fingerprint: str) -> str:
        ckpt = tmp_path / f"ckpt-{len(list(tmp_path.iterdir()))}"
        ckpt.mkdir()
        run = {
            "config": cfg.to_dict(),
            "stream": stream.state_dict(),
            "dataset_fingerprint": fingerprint,
        }
        (ckpt / "run.json").write_text(json.dumps(run))
        return str(ckpt)

    with ExitStack() as stack:
        cfg = from_dict(_cfg(data, tmp_path))
        td = _train_data(cfg, stack=stack)
        next(td.stream)
        path = saved(cfg, td.stream, td.fingerprint)
        swapped = from_dict(_cfg(data, tmp_path))
        swapped.data.sources.reverse()
        with pytest.raises(ConfigError, match=r"data.sources: .* in this order"):
            check_run_matches(path, swapped, _train_data(swapped, stack=stack).stream)
        state = json.loads((tmp_path / path / "run.json").read_text())
        state["stream"]["sources"]["books"]["fingerprint"] = "0" * 32  # a re-sharded copy
        (tmp_path / path / "run.json").write_text(json.dumps(state))
        with pytest.raises(ConfigError, match=r"data.sources\[1\]: source 'books' is dataset"):
            check_run_matches(path, cfg, _train_data(cfg, stack=stack).stream)
        cfg.data.allow_other_dataset = True
        check_run_matches(path, cfg, _train_data(cfg, stack=stack).stream)
        # a run on one dataset, resumed with a context stage: a one-source mixture from there on
        wide = {**_cfg(data, tmp_path), "parallel": {"policy": "hdp", "capacity": 1024}}
        plain = from_dict({**wide, "data": {"path": data["code"], "val_fraction": 0.1}})
        one = _train_data(plain, stack=stack)
        for _ in range(3):
            next(one.stream)
        path = saved(plain, one.stream, one.fingerprint)
        staged = from_dict(
            {**wide, "data": {"path": data["code"], "val_fraction": 0.1,
             "stages": [{"start_step": 1, "max_sample_tokens": 64}]}}
        )  # fmt: skip
        mix = _train_data(staged, stack=stack)
        state = check_run_matches(path, staged, mix.stream, mix.fingerprint)
        mix.stream.load_state_dict(state)
        b = next(mix.stream)
        assert b.step == 3 and b.lengths.max() <= 64 and mix.stream.epoch[0] == one.stream.epoch + 1


def test_tokenizer_identity_ignores_where_the_tokenizer_file_sits() -> None:
    """Two datasets tokenized by the same tokenizer file (same sha256) copied to two folders
    mix; another file, or other ids, is a difference naming the key and both values."""
    from datapipe.mix.sources import tokenizer_differences

    tok = {"kind": "hf", "path": "/data/a/tokenizer.json", "sha256": "ab12"}
    a = {"vocab_size": 4096, "bos_id": 1, "eos_id": 2, "dtype": "uint16", "tokenizer": tok}
    b = {**a, "tokenizer": {**tok, "path": "/elsewhere/tokenizer.json"}}
    assert tokenizer_differences(a, b) == ""
    c = {**b, "tokenizer": {**tok, "sha256": "cd34"}, "eos_id": 3}
    what = tokenizer_differences(a, c)
    assert what.startswith("eos_id 2 vs 3; tokenizer {") and "'ab12'" in what and "'cd34'" in what


def test_mix_sources_leave_out_empty_and_held_out_samples() -> None:
    """A source's training ids: its samples with tokens, less the held-out ones (zero-length
    samples carry no tokens and are left out of a mixture)."""
    from datapipe.mix.config import SourceConfig
    from datapipe.mix.sources import LoadedSource, mix_sources

    lengths = np.array([3, 0, 5, 0, 7, 2], np.int64)
    src = LoadedSource(SourceConfig(path="d"), "d", "d", None, {}, lengths, "f", "data.path")
    held = np.array([False, False, False, True, True, False])
    assert mix_sources([src])[0].ids.tolist() == [0, 2, 4, 5]
    assert mix_sources([src], [held])[0].ids.tolist() == [0, 2, 5]
