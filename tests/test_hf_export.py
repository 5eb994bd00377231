"""Hand-back to Hugging Face: `export_hf` of a loaded model is the input folder's tensors bit for bit;
transformers' `from_pretrained` reads an export without missing or unexpected weights and gives
mixlen's logits (trained weights, a context-extension override); exports are atomic; the model's
weights come back whole from a DCP checkpoint of 1, 2 or 3 ranks at zero 1 or 2, or 1 at zero 0."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import warnings

import pytest
import torch
from _dcp_join import flat_keys, save_as_ranks
from _hf_reference import CASES, ORIGINAL, assert_close_per_doc, hf_model, packed, save
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from datapipe.errors import InputError, MixlenError
from datapipe.files import host_tag
from trainer.checkpoint.files import write_checksums
from trainer.checkpoint.state import ModelState
from trainer.checkpoint.weights import read_model_weights
from trainer.model.export import export_hf
from trainer.model.pretrained import apply_overrides, inspect_pretrained, load_pretrained_weights
from trainer.model.transformer import build
from trainer.parallel.zero import ZeroOptimizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

LENGTHS = [70, 9, 41, 100]


def all_tensors(path: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def load(path: str, dtype: torch.dtype = torch.float32, shape=None) -> torch.nn.Module:
    pre = inspect_pretrained(path)
    model = build(shape or pre.shape, dtype=dtype)
    load_pretrained_weights(model, pre)
    return model


@contextlib.contextmanager
def transformers_warnings():
    """Collect transformers' logged warnings and Python warnings raised inside."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield records
    root.removeHandler(handler)
    records.extend(str(w.message) for w in caught)


def hf_load(path: str) -> torch.nn.Module:
    """transformers' from_pretrained, checking it reports no missing, unexpected or mismatched
    weights in its loading info or its log."""
    with transformers_warnings() as logged:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [], info
    assert info["mismatched_keys"] == [] and info["error_msgs"] == [], info
    bad = [m for m in logged if "weight" in m.lower() or "initialized" in m.lower()]
    assert bad == [], bad
    return model.eval()


def hf_logits(model: torch.nn.Module, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(d[None]).logits[0] for d in torch.split(ids, lengths)])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("case", "dtype", "shard_bytes"),
    [
        ("llama-tied", torch.float32, 2 * 1000**3),
        ("llama-linear", torch.bfloat16, 2 * 1000**3),
        ("qwen2", torch.bfloat16, 30_000),
        ("mistral", torch.float32, 30_000),
    ],
)
def test_export_of_a_load_is_the_input_bit_for_bit(tmp_path, case, dtype, shard_bytes):
    src = save(hf_model(case), str(tmp_path / "src"), dtype=dtype)
    pre = inspect_pretrained(src)
    model = load(src, dtype)
    weights = dict(model.named_parameters())
    files = export_hf(
        weights,
        pre.shape,
        pre.family,
        str(tmp_path / "out"),
        base_config=pre.config,
        shard_bytes=shard_bytes,
    )
    got, want = all_tensors(str(tmp_path / "out")), all_tensors(src)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype == dtype and torch.equal(got[name], t), name
    again = inspect_pretrained(str(tmp_path / "out"))
    assert again.shape == pre.shape and again.family is pre.family
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == str(dtype).removeprefix("torch.")
    for key in ("bos_token_id", "eos_token_id"):  # Llama's config.json has them, Qwen2's not
        assert config.get(key) == pre.config.get(key)
    sharded = sum(f.endswith(".safetensors") for f in files) > 1
    assert sharded == (shard_bytes < 10**6) == ("model.safetensors.index.json" in files)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary left


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["llama-tied", "llama-yarn", "llama-dynamic", "qwen2", "mistral"])
def test_transformers_reads_a_trained_export_and_gives_mixlens_logits(tmp_path, case):
    src = save(hf_model(case), str(tmp_path / "src"))
    pre = inspect_pretrained(src)
    model = load(src)
    with torch.no_grad():  # "training": every weight moves
        gen = torch.Generator().manual_seed(7)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    export_hf(
        dict(model.named_parameters()),
        pre.shape,
        pre.family,
        str(tmp_path / "out"),
        shard_bytes=50_000,
    )
    hf = hf_load(str(tmp_path / "out"))
    ids, pos, cu = packed(LENGTHS, pre.shape.vocab_size, seed=8)
    with torch.no_grad():
        mine = model(ids, pos, cu)
    # documents shortest first: transformers' dynamic NTK keeps the longest length it has seen
    order = sorted(range(len(LENGTHS)), key=lambda i: LENGTHS[i])
    by_doc = torch.split(ids, LENGTHS)
    want = dict(zip(order, (hf_logits(hf, by_doc[i], [LENGTHS[i]]) for i in order)))
    assert_close_per_doc(mine, torch.cat([want[i] for i in range(len(LENGTHS))]), LENGTHS, 1e-5)


@pytest.mark.timeout(60)
def test_context_extension_overrides_travel_into_the_export(tmp_path):
    """A Llama extended with a larger base and llama3 scaling to 4x its context: the exported
    config.json carries them and transformers computes what mixlen computes."""
    src = save(hf_model("llama-tied", max_position_embeddings=ORIGINAL), str(tmp_path / "src"))
    pre = inspect_pretrained(src)
    scaling = {
        "type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    }
    shape = apply_overrides(
        pre.shape,
        {
            "rope_theta": 2000.0,
            "rope_scaling": scaling,
            "max_position_embeddings": 4 * ORIGINAL,
            "dim": 64,
        },
        src + "/config.json",
    )
    model = load(src, shape=shape)
    export_hf(dict(model.named_parameters()), shape, "LlamaForCausalLM", str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_theta"] == 2000.0 and config["max_position_embeddings"] == 4 * ORIGINAL
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        **{k: v for k, v in scaling.items() if k != "type"},
    }
    hf = hf_load(str(tmp_path / "out"))
    ids, pos, cu = packed(LENGTHS, shape.vocab_size, seed=9)
    with torch.no_grad():
        mine = model(ids, pos, cu)
    assert_close_per_doc(mine, hf_logits(hf, ids, LENGTHS), LENGTHS, 1e-5)


@pytest.mark.timeout(60)
def test_a_dynamic_ntk_extension_exports_the_context_it_scales_from(tmp_path):
    """A Llama given dynamic NTK scaling (factor 4) and 4x its context: transformers scales past
    config.json's max_position_embeddings, so the export writes the original context there (the
    declared 4x would leave documents past the original unscaled), and transformers computes
    what mixlen computes on documents past it."""
    src = save(hf_model("llama-tied", max_position_embeddings=ORIGINAL), str(tmp_path / "src"))
    pre = inspect_pretrained(src)
    scaling = {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    overrides = {"rope_scaling": scaling, "max_position_embeddings": 4 * ORIGINAL}
    shape = apply_overrides(pre.shape, overrides, src + "/config.json")
    model = load(src, shape=shape)
    export_hf(dict(model.named_parameters()), shape, "LlamaForCausalLM", str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["max_position_embeddings"] == ORIGINAL < max(LENGTHS)
    hf = hf_load(str(tmp_path / "out"))
    ids, pos, cu = packed(LENGTHS, shape.vocab_size, seed=10)
    with torch.no_grad():
        mine = model(ids, pos, cu)
    order = sorted(range(len(LENGTHS)), key=lambda i: LENGTHS[i])  # see the test above
    by_doc = torch.split(ids, LENGTHS)
    want = dict(zip(order, (hf_logits(hf, by_doc[i], [LENGTHS[i]]) for i in order)))
    assert_close_per_doc(mine, torch.cat([want[i] for i in range(len(LENGTHS))]), LENGTHS, 1e-5)


def test_export_refuses_an_existing_folder_and_never_leaves_half_of_one(tmp_path, monkeypatch):
    src = save(hf_model("llama-tied"), str(tmp_path / "src"))
    pre = inspect_pretrained(src)
    weights = dict(load(src).named_parameters())
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(InputError, match="out: already exists"):
        export_hf(weights, pre.shape, pre.family, str(out))
    assert os.listdir(out) == ["keep.txt"]

    import safetensors.torch

    calls = []

    def failing_save(*args, **kwargs):  # the disk fills up after the first shard
        if calls:
            raise OSError(28, "No space left on device")
        calls.append(args)
        return real_save(*args, **kwargs)

    real_save = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    with pytest.raises(OSError, match="No space"):
        export_hf(weights, pre.shape, pre.family, str(out), shard_bytes=30_000, overwrite=True)
    assert os.listdir(out) == ["keep.txt"]  # untouched

    def full_disk(*args, **kwargs):  # what safetensors raises when its write fails
        raise safetensors.SafetensorError("Error while serializing: I/O error: File too large")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(
        MixlenError, match=r"\.out\.partial-\S+-\d+: cannot write model.safetensors"
    ):
        export_hf(weights, pre.shape, pre.family, str(out), overwrite=True)
    assert os.listdir(out) == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["out", "src"]
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    export_hf(weights, pre.shape, pre.family, str(out), overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]
    with pytest.raises(InputError, match="tok.json: tokenizer file missing"):
        export_hf(
            weights,
            pre.shape,
            pre.family,
            str(tmp_path / "o2"),
            tokenizer_files=[str(tmp_path / "tok.json")],
        )
    (tmp_path / "tok.json").write_text("{}")
    files = export_hf(
        weights,
        pre.shape,
        pre.family,
        str(tmp_path / "o2"),
        tokenizer_files=[str(tmp_path / "tok.json")],
    )
    assert "tok.json" in files and (tmp_path / "o2" / "tok.json").read_text() == "{}"


def test_a_killed_exports_leftovers_are_cleaned_by_the_next(tmp_path, caplog) -> None:
    """An export killed with no cleanup (SIGKILL, SIGTERM) leaves its temporary folder, and
    perhaps the old folder it had moved aside: the next export into that folder removes the
    first and puts the second back (before its own existence check), once their process is
    gone; a live process's and another host's are left alone."""
    import subprocess
    import sys

    src = save(hf_model("llama-tied"), str(tmp_path / "src"))
    pre = inspect_pretrained(src)
    weights = dict(load(src).named_parameters())
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid, me = int(dead.stdout), f"{host_tag()}-"
    out = tmp_path / "out"
    (tmp_path / f".out.partial-{me}{pid}").mkdir()  # a dead export's half-written folder
    (tmp_path / f".out.partial-{me}{pid}" / "model-00001-of-00002.safetensors").write_bytes(b"x")
    (tmp_path / f".out.old-{me}{pid}").mkdir()  # the folder it had moved aside, not yet replaced
    (tmp_path / f".out.old-{me}{pid}" / "keep.txt").write_text("old")
    kept = [f".out.partial-otherhost_1-{pid}",  # another host's: its pid means nothing here
            f".out.partial-{me}{os.getppid()}"]  # a live process's  # fmt: skip
    for name in kept:
        (tmp_path / name).mkdir()
    with pytest.raises(InputError, match="out: already exists"):
        export_hf(weights, pre.shape, pre.family, str(out))
    assert os.listdir(out) == ["keep.txt"] and "restored" in caplog.text
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "out", "src"])
    export_hf(weights, pre.shape, pre.family, str(out), overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "out", "src"])


class _Rank:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


# 1, 2 and 3 ranks at zero 1 and 2 (sliced optimizer state), 1 rank at zero 0 (every rank holds the
# whole state there: save_as_ranks joins slices, not copies), in float32; bf16 compute weights
# beside float32 master weights at 1 rank zero 0 and 3 ranks zero 2; island-prefixed keys once
DCP_CASES = [(r, z, torch.float32, False) for r in (1, 2, 3) for z in (1, 2)] + [
    (1, 0, torch.float32, False),
    (1, 0, torch.bfloat16, False),
    (3, 2, torch.bfloat16, False),
    (2, 1, torch.float32, True),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("ranks", "level", "dtype", "prefixed"),
    DCP_CASES,
    ids=[
        f"{r}-ranks-zero{z}{'-bf16' if d == torch.bfloat16 else ''}{'-islands' if p else ''}"
        for r, z, d, p in DCP_CASES
    ],
)
def test_dcp_checkpoint_reads_back_whole_under_any_ranks_and_zero(
    tmp_path, ranks, level, dtype, prefixed
):
    """The weights of a checkpoint of 1, 2 or 3 fake ranks at ZeRO 1 or 2, or 1 rank at ZeRO 0
    (bf16 compute weights beside float32 master slices in two cases) read back as the saved
    model's, and export as the source folder's tensors bit for bit."""
    src = save(hf_model("qwen2"), str(tmp_path / "src"), dtype=dtype)
    pre = inspect_pretrained(src)
    model = load(src, dtype)
    sds = []
    for r in range(ranks):  # each fake rank's DCP state: its weights and its optimizer slice
        net = copy.deepcopy(model)
        zero = ZeroOptimizer(list(net.parameters()), _Rank(r, ranks), level=level)
        zero.exp_avg.fill_(r + 1.0)
        sds.append(flat_keys(ModelState(net, zero, island=0, prefixed=prefixed).state_dict()))
    assert any(k.startswith("island0.model." if prefixed else "model.") for k in sds[0])
    assert any(".optim.master." in f".{k}" for k in sds[0]) == (dtype != torch.float32)
    step = tmp_path / "ckpt" / "step-00000002"
    step.mkdir(parents=True)
    save_as_ranks(str(step), sds)
    write_checksums(str(step))
    got = read_model_weights(str(tmp_path / "ckpt"))  # the newest complete checkpoint under it
    want = dict(model.named_parameters())
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t.detach()), name
    export_hf(got, pre.shape, pre.family, str(tmp_path / "out"))
    exported, source = all_tensors(str(tmp_path / "out")), all_tensors(src)
    assert sorted(exported) == sorted(source)  # no tensor missing or extra
    for name, t in source.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    with open(next(step.glob("*.distcp")), "r+b") as f:  # a flipped byte is named
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(InputError, match=r"step-00000002: .*distcp: XXH3-64 checksum differs"):
        read_model_weights(str(step))
    with pytest.raises(InputError, match="neither a checkpoint nor"):
        read_model_weights(str(tmp_path / "src"))


def test_every_case_is_a_known_family():
    from trainer.model.families import FAMILIES

    assert {cls.__name__ for cls, _, _ in CASES.values()} == set(FAMILIES)


def test_export_finds_the_tokenizer_files(tmp_path):
    """`mixlen export`'s tokenizer files: the pretrained folder's (tokenizer.json and its configs,
    none of the model's files), else those of the dataset's tokenizer (a --tokenizer-from folder
    or a --tokenizer file), else none (bytes, a tokenizer file gone, no dataset here)."""
    import shutil

    from datapipe.ingest.preprocess import PreprocessConfig, preprocess
    from tools.cmd_export import _tokenizer_files

    bpe = os.path.join(os.path.dirname(__file__), "assets", "bpe-stdlib.json")
    model = save(hf_model("llama-tied"), str(tmp_path / "model"))
    names = [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
        "chat_template.jinja",
    ]  # fmt: skip (transformers >= 4.50 saves the template apart)
    shutil.copyfile(bpe, os.path.join(model, names[0]))
    for n in names[1:]:
        (tmp_path / "model" / n).write_text("{}")
    want = [os.path.join(model, n) for n in ("tokenizer.json", "tokenizer_config.json")]
    want += [os.path.join(model, n) for n in ("chat_template.jinja", "generation_config.json")]
    assert _tokenizer_files({"data": {"path": "/nowhere"}}, model) == want

    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "def f(x):\\n    return x"}\n')

    def dataset(name: str, **tok: str) -> dict:
        out = str(tmp_path / name)
        preprocess(PreprocessConfig(inputs=[str(src)], out=out, progress=False, **tok))
        return {"data": {"path": out}}

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copyfile(bpe, folder / "tokenizer.json")
    (folder / "special_tokens_map.json").write_text("{}")
    assert _tokenizer_files(dataset("from-folder", tokenizer_from=str(folder)), None) == [
        str(folder / "tokenizer.json"),
        str(folder / "special_tokens_map.json"),
    ]
    shutil.copyfile(bpe, tmp_path / "bpe.json")
    by_file = dataset("from-file", tokenizer=str(tmp_path / "bpe.json"))
    assert _tokenizer_files(by_file, None) == [(str(tmp_path / "bpe.json"), "tokenizer.json")]
    # exported under the name transformers loads: its tokenizer encodes as the file does
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    pre = inspect_pretrained(model)
    out = str(tmp_path / "exported")
    weights = dict(load(model).named_parameters())
    files = export_hf(weights, pre.shape, pre.family, out, base_config=pre.config,
                      tokenizer_files=_tokenizer_files(by_file, None))  # fmt: skip
    assert "tokenizer.json" in files and "bpe.json" not in files
    text = "def f(x):\n    return x + 1"
    want_ids = Tokenizer.from_file(bpe).encode(text).ids
    assert AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False).input_ids == want_ids
    os.remove(tmp_path / "bpe.json")
    assert _tokenizer_files(by_file, None) == []
    assert _tokenizer_files(dataset("bytes"), None) == []
    assert _tokenizer_files({"data": {"path": str(tmp_path / "gone")}}, None) == []
    assert _tokenizer_files({}, None) == []
