"""Hostile input, round four (issue 29): `mixlen export` and `mixlen eval` of checkpoints and
folders. An output over the checkpoint being read (which deleted every checkpoint, or replaced a
step), over the run's pretrained folder, under a file or over the current directory is refused
before a byte is read, leaving the checkpoint byte-identical; `--island` of a run without that
island, a truncated run.json, a pretrained folder replaced after training, NaN weights and a
checkpoint removed while it is read are named; evaluations that would be empty or meaningless (no
held-out sample, no passkey depth, passkey lengths beyond the model's context or the ranks) are
refused, `--out` checked before the evaluation, and no output holds a bare NaN. Each refusal
exits 2 with one message and no traceback."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from _dcp_join import save_as_ranks
from _faults import cli_error, tree_digest, truncate
from _hf_reference import hf_model, save
from _train_worker import make_dataset, train_config

from tools.cli import main as cli_main
from trainer.checkpoint.checkpointer import latest_checkpoint
from trainer.checkpoint.files import write_checksums
from trainer.model.config import ModelSection

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]  # conftest.py

STEP3 = "step-00000003"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 3-step run of the debug model (a checkpoint after every step, all three kept)."""
    from trainer.train import run_training

    root = tmp_path_factory.mktemp("trained")
    data = make_dataset(str(root / "ds"), n_docs=40)
    c = train_config(data, str(root / "run"), train={"steps": 3, "eval_interval": 0},
                     checkpoint={"interval": 1, "keep": 3},
                     parallel={"policy": "single", "capacity": 4096})  # fmt: skip
    run_training(c)
    return root / "run"


@pytest.fixture(scope="module")
def from_pretrained(trained, tmp_path_factory) -> Path:
    """A 1-step run from a tiny Llama folder (context 128; a checkpoint at step 1): the root holds
    `hf` (the folder) and `run`."""
    from trainer.train import run_training

    root = tmp_path_factory.mktemp("pretrained")
    src = save(hf_model("llama-tied", vocab_size=300, bos_token_id=256, eos_token_id=257,
                        max_position_embeddings=1024), str(root / "hf"))  # fmt: skip
    c = train_config(str(trained.parent / "ds"), str(root / "run"),
                     train={"steps": 1, "eval_interval": 0}, checkpoint={"interval": 1},
                     parallel={"policy": "single", "capacity": 4096})  # fmt: skip
    c.model = ModelSection(pretrained=src)
    run_training(c)
    return root


@pytest.fixture(scope="module")
def ds(trained) -> str:
    """The trained run's dataset (40 byte-tokenized documents)."""
    return str(trained.parent / "ds")


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run this test may damage."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def test_export_never_writes_over_the_checkpoint_it_reads(run, capsys) -> None:
    """`export CKPT --hf CKPT --overwrite` deleted every checkpoint (and the lock), `export
    CKPT/step-3 --hf CKPT/step-3 --overwrite` replaced step 3 with the HF folder (a resume then fell
    back to step 2): both refused, as is an output inside the step or holding the checkpoint."""
    ckpt = run / "ckpt"
    step = ckpt / STEP3
    before = tree_digest(run)
    cases = [
        (ckpt, ckpt, "is the checkpoint"),
        (step, step, "is the checkpoint"),
        (step, ckpt, "holds the checkpoint"),
        (ckpt, run, "holds the checkpoint"),
        (step, step / "hf", "is inside the checkpoint"),
        (ckpt, ckpt / STEP3 / "hf", "is inside the checkpoint"),
    ]
    for src, out, what in cases:
        err = cli_error(["export", str(src), "--hf", str(out), "--overwrite"], capsys)
        assert f"--hf {out}: {what}" in err, err
    assert tree_digest(run) == before
    assert latest_checkpoint(str(ckpt)) == str(step)


def test_export_output_under_a_file_or_over_the_current_directory(run, capsys, monkeypatch):
    """`--hf metrics.jsonl/sub` (FileExistsError after the weights were read) and `--hf .
    --overwrite` (EBUSY) are refused before the checkpoint is read."""
    ckpt = str(run / "ckpt")
    err = cli_error(["export", ckpt, "--hf", str(run / "metrics.jsonl" / "sub")], capsys)
    assert f"--hf {run / 'metrics.jsonl' / 'sub'}: {run / 'metrics.jsonl'} is a file" in err
    elsewhere = run.parent / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    err = cli_error(["export", ckpt, "--hf", ".", "--overwrite"], capsys)
    assert "--hf .: is the current directory" in err
    err = cli_error(["export", ckpt, "--hf", "..", "--overwrite"], capsys)
    assert "--hf ..: holds the current directory" in err
    assert os.listdir(elsewhere) == []


def test_export_refuses_the_runs_pretrained_folder_as_output(from_pretrained, capsys) -> None:
    """`--hf` over the folder the run started from (its config.json is the run's shape) is
    refused like the checkpoint itself."""
    hf = from_pretrained / "hf"
    before = tree_digest(hf)
    err = cli_error(["export", str(from_pretrained / "run" / "ckpt"), "--hf", str(hf),
                     "--overwrite"], capsys)  # fmt: skip
    assert f"--hf {hf}: is the pretrained folder {hf}" in err, err
    assert tree_digest(hf) == before


@pytest.mark.parametrize("island", [3, 1])  # 1: one past the last (islands count from 0)
def test_export_island_beyond_the_runs_islands(run, capsys, island) -> None:
    """`export --island 3` on a run without islands exported island 0's weights without a word."""
    err = cli_error(["export", str(run / "ckpt"), "--hf", str(run / "out"), "--island",
                     str(island)], capsys)  # fmt: skip
    assert f"--island {island}: the run had 1 island (parallel.islands = 1)" in err, err
    assert not (run / "out").exists()


def test_a_damaged_run_json_is_named_before_it_is_parsed(ds, run, capsys) -> None:
    """A truncated run.json was parsed before the checksums were checked (a traceback): the
    checksum names it; with the checksums rewritten, its JSON error does."""
    step = run / "ckpt" / STEP3
    truncate(step / "run.json", 0.5)
    for argv in (["export", str(step), "--hf", str(run / "out")],
                 ["eval", str(step), ds]):  # fmt: skip
        err = cli_error(argv, capsys)
        assert f"{step}: run.json has" in err and "truncated?" in err, err
    write_checksums(str(step))
    err = cli_error(["export", str(step), "--hf", str(run / "out")], capsys)
    assert f"{step}/run.json: not valid JSON" in err, err


def test_a_pretrained_folder_replaced_after_training_is_named(
    ds, from_pretrained, tmp_path, capsys
):
    """The folder replaced by another shape after training: export and eval of the run's
    checkpoint stopped with a shape-mismatch ValueError / RuntimeError traceback."""
    root = Path(shutil.copytree(from_pretrained, tmp_path / "copy"))
    shutil.rmtree(root / "hf")
    save(hf_model("llama-tied", vocab_size=300, bos_token_id=256, eos_token_id=257,
                  max_position_embeddings=1024, intermediate_size=80), str(root / "hf"))  # fmt: skip
    ckpt = str(root / "run" / "ckpt")
    # the run's config names the copied folder's original path: point it at the replacement
    step = root / "run" / "ckpt" / "step-00000001"
    meta = json.loads((step / "run.json").read_text())
    meta["config"]["model"]["pretrained"] = str(root / "hf")
    (step / "run.json").write_text(json.dumps(meta))
    write_checksums(str(step))
    want = "feed_forward.w1.weight has shape (96, 64), but the model of "
    err = cli_error(["export", ckpt, "--hf", str(tmp_path / "out")], capsys)
    assert want in err and f"{root / 'hf'}/config.json needs (80, 64)" in err, err
    err = cli_error(["eval", ckpt, ds, "--split",
                     "all", "--no-passkey"], capsys)  # fmt: skip
    assert want in err, err


def test_non_finite_checkpoint_weights_are_named(ds, run, capsys) -> None:
    """A checkpoint whose weights hold a NaN (saved before runs stopped at one): export and eval
    name the tensor instead of writing or scoring NaN."""
    from trainer.checkpoint.weights import read_model_weights

    step = run / "ckpt" / STEP3
    weights = read_model_weights(str(step))
    weights["norm.weight"][3] = float("nan")
    for f in step.glob("*.distcp"):
        f.unlink()
    (step / ".metadata").unlink()
    (step / "checksums.json").unlink()
    save_as_ranks(str(step), [{f"model.{k}": v for k, v in weights.items()}])
    write_checksums(str(step))
    err = cli_error(["export", str(step), "--hf", str(run / "out")], capsys)
    assert f"{step}: weight norm.weight holds 1 non-finite value" in err, err
    err = cli_error(["eval", str(step), ds], capsys)
    assert f"{step}: weight norm.weight holds 1 non-finite value" in err, err


def test_a_checkpoint_removed_while_it_is_read(ds, run, capsys, monkeypatch) -> None:
    """A running training (`checkpoint.keep`) removed the checkpoint eval was reading: it was
    called "neither a checkpoint"; now the newest complete one is read instead when a checkpoint
    directory was named, and a named step directory is said to have been removed (one that was
    never completed is called incomplete)."""
    import trainer.checkpoint.weights as weights

    real = weights.verify_files
    gone: list[str] = []

    def remove_first(directory, files, rank, size):  # the training deletes it meanwhile
        if not gone:
            gone.append(directory)
            shutil.rmtree(directory)
        return real(directory, files, rank, size)

    monkeypatch.setattr(weights, "verify_files", remove_first)
    assert cli_main(["eval", str(run / "ckpt"), ds, "--split", "all", "--no-passkey",
                     "--json"]) == 0  # fmt: skip
    assert gone == [str(run / "ckpt" / STEP3)]
    assert json.loads(capsys.readouterr().out)["tokens"] > 0
    gone.clear()
    step = run / "ckpt" / "step-00000002"
    err = cli_error(["eval", str(step), ds, "--no-passkey"], capsys)
    assert f"{step}: removed while it was being read" in err, err
    step = run / "ckpt" / "step-00000001"  # still there, but never completed: not "removed"
    (step / "checksums.json").unlink()
    err = cli_error(["eval", str(step), ds, "--no-passkey"], capsys)
    assert "checksums.json is missing: the checkpoint is incomplete" in err, err
    assert "removed while" not in err and step.is_dir(), err


def test_evaluations_that_would_be_empty_are_refused(ds, run, from_pretrained, capsys, monkeypatch):
    """No held-out sample (loss NaN, exit 0, a bare NaN in --json), no passkey depth or length
    (`"passkey": []`), passkey lengths beyond the model's declared context or beyond what the ranks
    hold (called "sample 0 ... use --max-len"): each refused naming the flag."""
    ckpt = str(run / "ckpt")
    err = cli_error(["eval", ckpt, ds, "--val-fraction", "0.0001", "--no-passkey", "--json"],
                    capsys)  # fmt: skip
    assert "--split val: the held-out fraction 0.0001 (seed 0) selects none of the 40" in err
    for flag in ("--passkey-depths", "--passkey-lengths"):
        err = cli_error(["eval", ckpt, ds, flag, " , "], capsys)
        assert f"{flag}: no value given (--no-passkey skips passkey retrieval)" in err, err
    hf = str(from_pretrained / "hf")
    err = cli_error(["eval", hf, ds, "--passkey-lengths", "512,2048", "--split", "all"], capsys)
    assert "--passkey-lengths: 2,048 is longer than the model's context, 1,024 " in err, err
    err = cli_error(["eval", ckpt, ds, "--split", "all", "--passkey-lengths", "100000",
                     "--capacity", "4096"], capsys)  # fmt: skip
    assert "--passkey-lengths: 100,000 tokens is more than 1 rank of --capacity 4,096" in err


def test_eval_out_is_checked_before_the_evaluation(ds, run, capsys, monkeypatch) -> None:
    """`--out` naming an existing file failed with FileExistsError after the whole evaluation."""
    import trainer.eval.cli

    def never(*args, **kwargs):
        raise AssertionError("the evaluation ran")

    monkeypatch.setattr(trainer.eval.cli, "run_eval", never)
    (run / "taken").write_text("x")
    err = cli_error(["eval", str(run / "ckpt"), ds, "--out", str(run / "taken")], capsys)
    assert f"--out {run / 'taken'}: is a file, not a directory" in err, err
    err = cli_error(["eval", str(run / "ckpt"), ds, "--out", str(run / "taken" / "sub")], capsys)
    assert f"--out {run / 'taken' / 'sub'}: {run / 'taken'} is a file, not a directory" in err


def test_an_existing_hf_is_refused_before_the_checkpoint_is_read(run, capsys, monkeypatch):
    """Without --overwrite an existing --hf was refused only after every weight was read."""
    import trainer.checkpoint.weights

    def never(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(trainer.checkpoint.weights, "read_checkpoint", never)
    (run / "out").mkdir()
    err = cli_error(["export", str(run / "ckpt"), "--hf", str(run / "out")], capsys)
    assert f"--hf {run / 'out'}: already exists (pass --overwrite to replace it)" in err, err


def test_eval_reports_samples_beyond_the_models_context_and_never_a_bare_nan(
    ds, from_pretrained, capsys
) -> None:
    """A model declaring 128 positions on samples up to ~500 tokens: the report says how many
    samples lie beyond its context; --json output parses as strict JSON (no NaN token)."""
    root = Path(from_pretrained)
    hf = save(hf_model("llama-tied", vocab_size=300, bos_token_id=256, eos_token_id=257),
              str(root.parent / "short-context"))  # fmt: skip
    assert cli_main(["eval", hf, ds, "--split", "all", "--no-passkey", "--json"]) == 0
    text = capsys.readouterr().out

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in --json output")

    got = json.loads(text, parse_constant=refuse)
    assert got["beyond_context"] > 0 and got["context"] == 128
    assert cli_main(["eval", hf, ds, "--split", "all", "--no-passkey"]) == 0
    assert f"{got['beyond_context']} samples are longer than the model's context (128" in (
        capsys.readouterr().out
    )


def test_eval_nproc_refuses_once_before_any_rank_starts(ds, run, capsys, monkeypatch) -> None:
    """Round five: under --nproc a checkpoint's missing shard file, a --tp that does not divide
    the vocabulary and samples longer than the ranks hold were found after torchrun started the
    ranks, and printed once per rank; now the launcher refuses each once, before any rank
    starts (as train does), and the planner's error names --capacity and --nproc (it named
    `num_ranks`), in one process too."""
    import tools.launch

    def never(*args, **kwargs):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(tools.launch, "launch", never)
    step = run / "ckpt" / STEP3
    quiet = ["--no-passkey", "--split", "all"]
    err = cli_error(["eval", str(run / "ckpt" / "step-00000002"), ds, "--nproc", "4", "--tp", "4",
                     *quiet], capsys)  # fmt: skip
    assert "error: --tp: 4 does not divide the model's vocab_size (258)" in err, err
    for nproc in ("2", "1"):
        err = cli_error(["eval", str(step), ds, "--nproc", nproc, "--capacity", "16", *quiet],
                        capsys)  # fmt: skip
        assert "raise --capacity or --nproc" in err and "num_ranks" not in err, err
    shard = sorted(p for p in step.iterdir() if p.suffix == ".distcp")[0]
    shard.unlink()
    err = cli_error(["eval", str(step), ds, "--nproc", "2", *quiet], capsys)
    assert f"error: {step}: {shard.name} is missing" in err, err


def test_a_scratch_exports_token_ids_and_a_float16_overflow(ds, run, capsys) -> None:
    """A model trained from scratch exports its dataset's BOS and EOS ids (config.json had none,
    so transformers took its defaults 1 and 2); with the dataset gone, explicit nulls. A float16
    export of a weight beyond float16's range is refused naming the tensor, leaving nothing (it
    wrote infinities that mixlen itself then refused to load)."""
    from transformers import AutoConfig, LlamaConfig

    from datapipe.index import read_manifest
    from tools.cmd_export import _token_ids
    from trainer.checkpoint.weights import read_model_weights

    m = read_manifest(ds)
    assert cli_main(["export", str(run / "ckpt"), "--hf", str(run / "hf")]) == 0
    got = AutoConfig.from_pretrained(run / "hf")
    assert (got.bos_token_id, got.eos_token_id) == (m["bos_id"], m["eos_id"]) == (256, 257)
    unknown = _token_ids({"data": {"path": str(run / "gone")}})
    assert unknown == {"bos_token_id": None, "eos_token_id": None}
    assert LlamaConfig.from_dict(unknown).bos_token_id is None  # not transformers' default 1
    step = run / "ckpt" / STEP3
    weights = read_model_weights(str(step))
    weights["norm.weight"][3] = 1e5  # float16's largest is 65,504
    for f in [*step.glob("*.distcp"), step / ".metadata", step / "checksums.json"]:
        f.unlink()
    save_as_ranks(str(step), [{f"model.{k}": v for k, v in weights.items()}])
    write_checksums(str(step))
    before = sorted(os.listdir(run))
    err = cli_error(["export", str(step), "--hf", str(run / "f16"), "--dtype", "float16"], capsys)
    assert "--dtype float16: model.norm.weight holds values beyond that dtype's range" in err, err
    assert sorted(os.listdir(run)) == before  # no folder, no temporary one
    assert cli_main(["export", str(step), "--hf", str(run / "bf16"), "--dtype", "bfloat16"]) == 0


def test_export_shard_size_splits_the_weights_and_transformers_reads_them(
    run, tmp_path, capsys
) -> None:
    """--shard-size 1 MiB on a model of ~5 MB (the run's step rewritten at dim 256): several
    shards with model.safetensors.index.json, and transformers' from_pretrained of the folder
    gives the logits of the single-file export exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    from datapipe.settings import from_mapping
    from trainer.config.job import TrainerConfig
    from trainer.model.transformer import build

    step = tmp_path / STEP3  # a copy: the module's run stays as it is
    shutil.copytree(run / "ckpt" / STEP3, step)
    cfg = json.loads((step / "run.json").read_text())
    cfg["config"]["model"].update(dim=256, ffn_dim=512)
    (step / "run.json").write_text(json.dumps(cfg))
    model = build(from_mapping(TrainerConfig, cfg["config"]).model.shape())
    for f in [*step.glob("*.distcp"), step / ".metadata", step / "checksums.json"]:
        f.unlink()
    save_as_ranks(str(step), [{f"model.{k}": v.detach() for k, v in model.named_parameters()}])
    write_checksums(str(step))
    logits = {}
    for name, extra in (("one", []), ("shards", ["--shard-size", str(1 << 20)])):
        assert cli_main(["export", str(step), "--hf", str(tmp_path / name), *extra]) == 0
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
        with torch.no_grad():
            logits[name] = hf(torch.arange(40)[None] % 258).logits
    capsys.readouterr()
    shards = sorted(p.name for p in (tmp_path / "shards").glob("*.safetensors"))
    assert len(shards) >= 4 and (tmp_path / "shards" / "model.safetensors.index.json").is_file()
    assert [p.name for p in (tmp_path / "one").glob("*.safetensors")] == ["model.safetensors"]
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert torch.equal(logits["one"], logits["shards"])
