"""Object stores for real, against moto's S3 server on 127.0.0.1 (random free port, started and
stopped here; credentials from environment variables set here): `preprocess --out s3://...` uploads
through mosaicml-streaming's uploader with the manifest last; `data.path = "s3://..."` streams and
trains through the library's download cache; a read survives the server being restarted
mid-epoch; a missing bucket and wrong credentials give mixlen's own errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from readback import read_rows, samples_from_rows

from datapipe.errors import InputError, MixlenError, StoreError
from datapipe.fetch import FetchConfig
from datapipe.files import host_tag
from datapipe.index import read_index, resolve_dataset, uri_key
from datapipe.ingest.preprocess import PreprocessConfig, preprocess
from datapipe.ingest.upload import STAGE_PREFIX
from datapipe.settings import Names
from datapipe.stream import StreamConfig
from tools.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("moto.server", reason="moto[s3] is a test-only dependency (.[dev])")
from _s3 import KEY, SECRET  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _upload(corpus: dict, uri: str, spy: list | None = None, monkeypatch=None) -> Path:
    """Preprocess the corpus locally (the reference) and into `uri`; returns the local copy."""
    local = corpus["tmp"] / "local"
    if not local.exists():
        preprocess(
            PreprocessConfig(corpus["inputs"], str(local), chunk_tokens=64, shard_bytes=2000)
        )
    if spy is not None:
        from streaming.base.storage import upload as up

        orig = up.S3Uploader.upload_file
        monkeypatch.setattr(
            up.S3Uploader, "upload_file", lambda self, n: (spy.append(n), orig(self, n))[1]
        )
    staging = corpus["tmp"] / "staging"
    args = ["--chunk-tokens", "64", "--shard-size", "2000", "--quiet", "--staging", str(staging)]
    assert cli_main(["preprocess", *corpus["inputs"], "--out", uri, *args]) == 0
    assert list(staging.iterdir()) == [], "the staging copy is removed after the upload"
    return local


def test_upload_manifest_last_then_stream_and_fetch(s3, corpus, tmp_path, monkeypatch) -> None:
    uri = f"s3://{s3['bucket']}/prefix/ds"
    order: list[str] = []
    local = _upload(corpus, uri, order, monkeypatch)
    listed = s3["client"].list_objects_v2(Bucket=s3["bucket"], Prefix="prefix/ds/")["Contents"]
    keys = sorted(o["Key"].removeprefix("prefix/ds/") for o in listed)
    manifest = json.loads(
        s3["client"].get_object(Bucket=s3["bucket"], Key="prefix/ds/manifest.json")["Body"].read()
    )
    shards = [s["name"] for s in manifest["shards"]]
    assert keys == sorted([*shards, "index.json", "index.parquet", "manifest.json"])
    assert order[-1] == "manifest.json" and sorted(order) == keys, "every file once, manifest last"
    assert order.index("index.parquet") > max(order.index(s) for s in shards)
    assert manifest["args"]["out"] == uri
    # the uploaded objects are the local engine's bytes (same inputs, same settings)
    for s in shards:
        body = s3["client"].get_object(Bucket=s3["bucket"], Key=f"prefix/ds/{s}")["Body"].read()
        assert body == (local / s).read_bytes()
    # stream: the same global batches as the local dataset
    cache = tmp_path / "cache"
    remote_stream = StreamConfig(seed=3).open(uri, 600, cache_dir=str(cache))
    local_stream = StreamConfig(seed=3).open(str(local), 600)
    batches = [next(remote_stream) for _ in range(4)]
    for b in batches:
        ref = next(local_stream)
        np.testing.assert_array_equal(b.sample_ids, ref.sample_ids)
        np.testing.assert_array_equal(b.lengths, ref.lengths)
    listed = [n for n in os.listdir(cache) if not n.startswith(".")]  # and its lock file
    assert listed == [uri_key(uri)], "a folder per dataset"
    folder = cache / uri_key(uri)
    assert sorted(os.listdir(folder)) == ["index.parquet", "manifest.json"], "metadata first"
    # fetch: every sample of those batches, through the download cache, equals the local tokens
    ref = samples_from_rows(read_rows(str(local), read_index(str(local)).manifest))
    with FetchConfig().build(uri, str(cache)) as fetcher:
        for b in batches:
            for sid, n in zip(b.sample_ids.tolist(), b.lengths.tolist()):
                mb = fetcher.fetch(np.array([[sid, 0, n]]))
                np.testing.assert_array_equal(mb.input_ids, ref[sid])
    cached = [s for s in shards if (folder / s).exists()]
    assert 1 <= len(cached) <= len(shards)
    for s in cached:  # downloaded whole and intact
        assert (folder / s).read_bytes() == (local / s).read_bytes()
    # a dataset is never replaced in a store
    with pytest.raises(InputError, match="already holds a dataset"):
        preprocess(PreprocessConfig(corpus["inputs"], uri, overwrite=True, progress=False))


def _output(proc: subprocess.Popen) -> tuple[bytes, bytes]:
    """A launched command's output, the command (and its group) killed first if still running."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()


@pytest.mark.timeout(120)
def test_an_upload_stopped_or_killed_leaves_no_staging_copy(s3, corpus, tmp_path) -> None:
    """SIGTERM while the dataset is being uploaded (the store down, the upload retrying): exit
    130, the staging copy removed. A copy a killed upload left (SIGKILL: no cleanup runs) is
    removed by the next upload on this host once its process is gone; another host's, or a
    running process's, is left alone."""
    staging = tmp_path / "staging"
    marker = tmp_path / "paused"
    env = dict(os.environ, MIXLEN_TEST_PAUSE_AFTER_FIRST_SHARD=str(marker), PYTHONPATH=str(ROOT),
               MIXLEN_STORE_RETRIES="30")  # fmt: skip
    cmd = [sys.executable, "-m", "tools.cli", "preprocess", *corpus["inputs"], "--out",
           f"s3://{s3['bucket']}/term/ds", "--staging", str(staging), "--shard-size", "2000",
           "--chunk-tokens", "64", "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():  # the bucket checked, one shard written
            assert proc.poll() is None and time.monotonic() < deadline, _output(proc)
            time.sleep(0.05)
        s3["server"].stop()
        marker.unlink()
        while not list(staging.glob("*/dataset/manifest.json")):  # staged: the upload is on
            assert proc.poll() is None and time.monotonic() < deadline, _output(proc)
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        s3["server"].start()
    assert proc.returncode == 130 and "interrupted" in err.decode(), err.decode()[-2000:]
    assert list(staging.iterdir()) == []
    host = host_tag()  # the host and PID namespace
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    left = {  # name: kept by the next upload
        f"{STAGE_PREFIX}{host}-{int(dead.stdout)}-0a1b2c3d": False,
        f"{STAGE_PREFIX}{host}-{os.getppid()}-0a1b2c3d": True,  # running
        f"{STAGE_PREFIX}otherhost-{int(dead.stdout)}": True,  # its pid means nothing here
    }
    for name in left:
        (staging / name / "dataset").mkdir(parents=True)
        (staging / name / "dataset" / "shard.00000.mds").write_bytes(b"x" * 100)
    args = ["--chunk-tokens", "64", "--quiet", "--staging", str(staging)]
    assert cli_main(["preprocess", *corpus["inputs"], "--out", f"s3://{s3['bucket']}/k/ds",
                     *args]) == 0  # fmt: skip
    assert sorted(p.name for p in staging.iterdir()) == sorted(n for n, k in left.items() if k)


def test_leftover_parts_are_aborted_and_a_dataset_made_meanwhile_is_kept(s3, corpus) -> None:
    """A killed upload's unfinished multipart upload under the prefix (its parts stay, billed)
    is aborted by the next upload there. A dataset another tool (which makes no claim on the
    prefix) copied there while this one tokenized is refused before anything is uploaded
    (before: replaced without a word)."""
    from datapipe.ingest.upload import preprocess_to_store

    client, bucket = s3["client"], s3["bucket"]
    part = client.create_multipart_upload(Bucket=bucket, Key="mp/ds/shard.00000.mds")
    client.upload_part(Bucket=bucket, Key="mp/ds/shard.00000.mds", PartNumber=1,
                       UploadId=part["UploadId"], Body=b"x" * 1024)  # fmt: skip
    client.create_multipart_upload(Bucket=bucket, Key="mp/other/shard.00000.mds")  # not ours
    warned: list[str] = []
    cfg = PreprocessConfig(corpus["inputs"], f"s3://{bucket}/mp/ds", progress=False)
    preprocess(cfg, warn=warned.append)
    left = client.list_multipart_uploads(Bucket=bucket, Prefix="mp/").get("Uploads", [])
    assert [u["Key"] for u in left] == ["mp/other/shard.00000.mds"]
    assert any("aborted 1 unfinished multipart upload" in w for w in warned), warned
    uri = f"s3://{bucket}/race/ds"

    def meanwhile(local_cfg, warn):  # a dataset copied there by another tool (no claim) lands
        res = preprocess(local_cfg, warn)  # while this one tokenizes
        other = corpus["tmp"] / "other"
        preprocess(PreprocessConfig(corpus["inputs"][:1], str(other), progress=False))
        for f in sorted(other.iterdir(), key=lambda f: f.name == "manifest.json"):
            client.upload_file(str(f), bucket, f"race/ds/{f.name}")
        return res

    with pytest.raises(InputError, match="was written there while this run tokenized"):
        preprocess_to_store(PreprocessConfig(corpus["inputs"], uri, progress=False), meanwhile,
                            print)  # fmt: skip
    kept = json.loads(client.get_object(Bucket=bucket, Key="race/ds/manifest.json")["Body"].read())
    assert kept["args"]["inputs"] == corpus["inputs"][:1], "the other job's dataset stays"

    def disk_full(local_cfg, warn):  # the local run's own message names its --out: the staging
        raise MixlenError(f"--out {local_cfg.out}: writing failed (disk full or file size limit)")

    cfg = PreprocessConfig(corpus["inputs"], f"s3://{bucket}/full/ds", progress=False)
    with pytest.raises(MixlenError, match=r"^--staging \S+ \(the local copy of --out s3://"):
        preprocess_to_store(cfg, disk_full, print)
    assert kept["args"]["inputs"] == corpus["inputs"][:1], "the other job's dataset stays"


def test_train_from_s3_equals_local(s3, tmp_path) -> None:
    from _train_worker import make_dataset, train_config

    from trainer.train import run_training

    local = make_dataset(str(tmp_path / "ds"), n_docs=60)
    uri = f"s3://{s3['bucket']}/train/ds"
    assert cli_main(["preprocess", str(tmp_path / "ds.jsonl"), "--out", uri, "--chunk-tokens",
                     "128", "--quiet"]) == 0  # fmt: skip
    runs = {}
    for name, path in (("local", local), ("s3", uri)):
        cfg = train_config(
            path,
            str(tmp_path / f"run-{name}"),
            parallel={"policy": "single"},
            train={"steps": 3, "eval_interval": 3},
            checkpoint={"dir": None},
        )
        cfg.data.cache_dir = str(tmp_path / f"cache-{name}")
        runs[name] = run_training(cfg)
    assert runs["s3"]["losses"] == runs["local"]["losses"]
    assert runs["s3"]["val_losses"] == runs["local"]["val_losses"]
    assert any(
        p.name.startswith("shard.") for p in (tmp_path / "cache-s3" / uri_key(uri)).iterdir()
    )


def test_two_remote_datasets_share_a_cache_folder(s3, tmp_path) -> None:
    """`data.path` and `data.val_path` (or two jobs) with one `data.cache_dir`: each dataset gets
    its own folder in it and reads its own samples, fresh or already cached; a damaged shard in
    the cache is fetched again."""
    from _train_worker import make_dataset

    want = {}
    for name, n_docs in (("train", 30), ("val", 7)):
        local = make_dataset(str(tmp_path / name), n_docs=n_docs, seed=len(name))
        uri = f"s3://{s3['bucket']}/two/{name}"
        assert cli_main(["preprocess", str(tmp_path / f"{name}.jsonl"), "--out", uri,
                         "--chunk-tokens", "128", "--quiet"]) == 0  # fmt: skip
        want[uri] = samples_from_rows(read_rows(local, read_index(local).manifest))
    cache = str(tmp_path / "cache")
    for _ in range(2):  # a fresh cache, then the same cache again
        for uri, ref in want.items():
            with FetchConfig().build(uri, cache) as fetcher:
                assert len(fetcher.lengths) == len(ref)
                for sid, n in enumerate(fetcher.lengths.tolist()):
                    mb = fetcher.fetch(np.array([[sid, 0, n]]))
                    np.testing.assert_array_equal(mb.input_ids, ref[sid])
        # a damaged copy in the cache is fetched again from the store
        folder = os.path.join(cache, uri_key(uri))
        shards = sorted(f for f in os.listdir(folder) if f.startswith("shard."))
        os.truncate(os.path.join(folder, shards[0]), 10)


def test_a_dataset_written_anew_at_its_uri_is_not_read_from_the_old_cache(s3, tmp_path) -> None:
    """The prefix deleted and another dataset written there: the old one's cache reads the new
    one; an unchanged one keeps its shards; the store down, a cached one is read after one try."""
    from _train_worker import make_dataset

    uri, cache = f"s3://{s3['bucket']}/anew/ds", str(tmp_path / "cache")
    folder = os.path.join(cache, uri_key(uri))
    for k, n_docs in enumerate((30, 12)):
        local = make_dataset(str(tmp_path / f"v{k}"), n_docs=n_docs, seed=k + 5)
        if k:  # the old dataset's objects deleted, then the new one written
            for o in s3["client"].list_objects_v2(Bucket=s3["bucket"], Prefix="anew/")["Contents"]:
                s3["client"].delete_object(Bucket=s3["bucket"], Key=o["Key"])
        assert cli_main(["preprocess", str(tmp_path / f"v{k}.jsonl"), "--out", uri,
                         "--chunk-tokens", "128", "--quiet"]) == 0  # fmt: skip
        ref = samples_from_rows(read_rows(local, read_index(local).manifest))
        for _ in range(2):  # the second time: the shards already cached are kept
            before = os.listdir(folder) if os.path.isdir(folder) else []
            with FetchConfig().build(uri, cache) as fetcher:
                assert len(fetcher.lengths) == len(ref)
                for sid, n in enumerate(fetcher.lengths.tolist()):
                    mb = fetcher.fetch(np.array([[sid, 0, n]]))
                    np.testing.assert_array_equal(mb.input_ids, ref[sid])
        assert set(before) <= set(os.listdir(folder)) and "shard.00000.mds" in before
    s3["server"].stop()  # a cached dataset: one try (no backoff of 0.5 s and more), the copy
    with pytest.MonkeyPatch.context() as mp:
        naps: list[float] = []
        mp.setenv("MIXLEN_STORE_RETRIES", "5")
        mp.setattr("datapipe.store.time.sleep", naps.append)
        try:
            assert len(read_index(resolve_dataset(uri, cache)[0]).num_tokens) == len(ref)
        finally:
            s3["server"].start()
    assert not [t for t in naps if t >= 0.5], naps


def test_resume_after_server_restart_mid_epoch(s3, corpus, tmp_path, monkeypatch) -> None:
    uri = f"s3://{s3['bucket']}/restart/ds"
    local = _upload(corpus, uri)
    ref = samples_from_rows(read_rows(str(local), read_index(str(local)).manifest))
    srv = s3["server"]
    stream = StreamConfig(seed=1).open(uri, 500, cache_dir=str(tmp_path / "c"))
    steps = [next(stream) for _ in range(8)]
    with FetchConfig().build(uri, str(tmp_path / "c")) as fetcher:

        def check(batch) -> None:
            for sid, n in zip(batch.sample_ids.tolist(), batch.lengths.tolist()):
                mb = fetcher.fetch(np.array([[sid, 0, n]]))
                np.testing.assert_array_equal(mb.input_ids, ref[sid])

        check(steps[0])
        srv.stop()
        try:  # one attempt: a read needing a new shard fails with mixlen's error
            with pytest.raises(
                StoreError, match=r"cannot reach the object store at http://127"
            ) as e:
                for b in steps[1:]:
                    check(b)
            assert e.value.transient and uri in str(e.value)
        finally:
            srv.start()
        for b in steps[1:4]:  # the same fetcher reads on once the server is back
            check(b)
        # with retries, an outage shorter than the backoff is invisible: restart after 0.5 s
        monkeypatch.setenv("MIXLEN_STORE_RETRIES", "8")
        srv.stop()
        timer = threading.Timer(0.5, srv.start)
        timer.start()
        try:
            for b in steps[4:]:
                check(b)
        finally:
            timer.join()
    shards = [s["name"] for s in read_index(str(local)).manifest["shards"]]
    folder = tmp_path / "c" / uri_key(uri)
    assert sum((folder / s).exists() for s in shards) > 2, "several shards were fetched"


def test_missing_bucket_and_wrong_credentials(s3, corpus, tmp_path, monkeypatch, capsys) -> None:
    # missing bucket: upload refused before any tokenizing, reading names the URI
    uri = "s3://no-such-bucket/ds"
    rc = cli_main(["preprocess", *corpus["inputs"], "--out", uri, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{uri}: bucket 'no-such-bucket' does not exist (404)" in err, err
    with pytest.raises(
        StoreError, match=r"^data.path: s3://no-such-bucket/ds/manifest.json: not found"
    ):
        StreamConfig().open(uri, 100, cache_dir=str(tmp_path / "c0"), names=Names("data"))
    # a good dataset, then wrong credentials (moto checks keys once auth is on)
    good = f"s3://{s3['bucket']}/creds/ds"
    _upload(corpus, good)
    url = s3["server"].url
    iam = __import__("boto3").client(
        "iam", endpoint_url=url, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )  # fmt: skip
    iam.create_user(UserName="mixlen")
    key = iam.create_access_key(UserName="mixlen")["AccessKey"]
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}  # fmt: skip
    iam.put_user_policy(UserName="mixlen", PolicyName="all", PolicyDocument=json.dumps(policy))
    _set_auth(url, True)
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        StreamConfig().open(good, 100, cache_dir=str(tmp_path / "c1"))  # the right key works
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(StoreError, match="access denied") as e:
            StreamConfig().open(good, 100, cache_dir=str(tmp_path / "c2"))
        msg = str(e.value)
        assert "AWS_ACCESS_KEY_ID" in msg and "not found" not in msg and "MOSAICML" not in msg
        assert e.value.kind == "denied"
        rc = cli_main(
            ["preprocess", *corpus["inputs"], "--out", f"s3://{s3['bucket']}/x", "--quiet"]
        )
        err = capsys.readouterr().err
        assert rc == 2 and f"s3://{s3['bucket']}/x: access denied (403)" in err, err
        assert "Traceback" not in err
    finally:
        _set_auth(url, False)


def _set_auth(url: str, on: bool) -> None:
    """Switch moto's request authentication on (after 0 free requests) or off."""
    req = urllib.request.Request(
        url + "/moto-api/reset-auth",
        data=b"0" if on else b"inf",
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def test_unsupported_scheme_is_named(corpus, tmp_path, capsys) -> None:
    """A scheme mosaicml-streaming cannot write is refused before any work, listing those it can;
    one it cannot read is named when a dataset is opened."""
    rc = cli_main(["preprocess", *corpus["inputs"], "--out", "xyz://b/ds", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "xyz://b/ds: scheme 'xyz' cannot be written" in err and "s3://" in err
    with pytest.raises(StoreError, match="data.path: xyz://b/ds/manifest.json: scheme 'xyz'"):
        StreamConfig().open("xyz://b/ds", 100, cache_dir=str(tmp_path / "c"), names=Names("data"))


def test_a_mixture_of_a_local_and_an_s3_source_reads_as_two_local_ones(s3, tmp_path) -> None:
    """[data] sources mixes a local dataset with one in the store: the same batches and the same
    fetched tokens as with both local (the store's copy downloaded under cache_dir/NAME/KEY)."""
    from contextlib import ExitStack

    from _train_worker import make_dataset, train_config

    code = make_dataset(str(tmp_path / "code"), n_docs=40, seed=1)
    books = make_dataset(str(tmp_path / "books"), n_docs=20, max_chars=900, seed=2)
    uri = f"s3://{s3['bucket']}/mix/books"
    assert cli_main(["preprocess", str(tmp_path / "books.jsonl"), "--out", uri, "--chunk-tokens",
                     "128", "--quiet"]) == 0  # fmt: skip
    fetched = {}
    for name, path in (("local", books), ("s3", uri)):
        cfg = train_config(
            code,
            str(tmp_path / f"run-{name}"),
            checkpoint={"dir": None},
            parallel={"capacity": 1024},
        )
        cfg.data.path = ""
        cfg.data.sources = [_source(code, 0.5, "code"), _source(path, 0.5, "books")]
        cfg.data.cache_dir = str(tmp_path / f"cache-{name}")
        cfg.validate()
        with ExitStack() as stack:
            td = cfg.train_data(0, 1, stack, validation=False)
            out = []
            for _, (batch, plan, _) in zip(range(3), td.plans()):
                mbs = td.fetcher.fetch_step(td.pieces(plan, batch))
                out.append((batch.digest(), [mb.input_ids.tolist() for mb in mbs]))
            fetched[name] = out
    assert fetched["s3"] == fetched["local"]
    assert (tmp_path / "cache-s3" / "books" / uri_key(uri) / "manifest.json").exists()


def _source(path: str, weight: float, name: str):
    from datapipe.mix.config import SourceConfig

    return SourceConfig(path=path, weight=weight, name=name)


def test_store_retries_default_count_and_backoff(monkeypatch) -> None:
    """An unreachable store: 5 attempts by default (MIXLEN_STORE_RETRIES unset), the waits
    between them doubling from 0.5 s and capped at 8 s (hand-written lists)."""
    from botocore.exceptions import EndpointConnectionError

    from datapipe.store import with_retries

    naps: list[float] = []
    calls: list[int] = []
    monkeypatch.setattr("datapipe.store.time.sleep", naps.append)

    def down() -> None:
        calls.append(1)
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")

    for env, attempts, waits in ((None, 5, [0.5, 1, 2, 4]), ("8", 8, [0.5, 1, 2, 4, 8, 8, 8])):
        if env is None:
            monkeypatch.delenv("MIXLEN_STORE_RETRIES", raising=False)
        else:
            monkeypatch.setenv("MIXLEN_STORE_RETRIES", env)
        naps.clear()
        calls.clear()
        with pytest.raises(StoreError, match=rf"cannot reach .*\(after {attempts} attempts\)$"):
            with_retries("s3://b/ds/manifest.json", "read", down)
        assert len(calls) == attempts and naps == waits
