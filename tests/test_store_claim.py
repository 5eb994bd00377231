"""One upload per s3:// prefix at a time, against moto's S3 server on 127.0.0.1: the claim object
`.mixlen-upload.json` (a conditional put) refuses a second upload to a prefix one is writing,
names the job that holds it, is taken over from a killed job of this host, is checked before the
manifest goes up, and is gone once the upload ends, well or badly. The reference is the store's
own listing and objects, and a local run of the same inputs."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

import pytest

from datapipe.errors import InputError
from datapipe.files import host_tag
from datapipe.ingest.claim import CLAIM_FILE, PrefixClaim
from datapipe.ingest.preprocess import PreprocessConfig, preprocess
from datapipe.ingest.upload import preprocess_to_store

pytest.importorskip("moto.server", reason="moto[s3] is a test-only dependency (.[dev])")

pytestmark = pytest.mark.timeout(120)


def _keys(s3: dict, prefix: str) -> list[str]:
    listed = s3["client"].list_objects_v2(Bucket=s3["bucket"], Prefix=prefix)
    return sorted(o["Key"].removeprefix(prefix) for o in listed.get("Contents", []))


def _manifest(s3: dict, key: str) -> dict:
    return json.loads(s3["client"].get_object(Bucket=s3["bucket"], Key=key)["Body"].read())


def _put_claim(s3: dict, prefix: str, body: dict) -> None:
    s3["client"].put_object(Bucket=s3["bucket"], Key=prefix + CLAIM_FILE, Body=json.dumps(body))


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    return int(done.stdout)


def test_a_second_upload_to_a_prefix_being_written_is_refused(s3, corpus) -> None:
    """Job B starts while job A tokenizes for the same prefix. Before the claim, B uploaded its
    dataset, and two jobs uploading at once interleaved their shards under one manifest; now B
    is refused naming A, and A's dataset is whole: its files are a local run's bytes."""
    uri = f"s3://{s3['bucket']}/two/ds"
    refused: list[str] = []

    def with_a_second_job(local_cfg, warn):
        res = preprocess(local_cfg, warn)
        with pytest.raises(InputError) as err:
            preprocess(PreprocessConfig(corpus["inputs"][:1], uri, progress=False))
        refused.append(str(err.value))
        return res

    warned: list[str] = []
    cfg = PreprocessConfig(corpus["inputs"], uri, progress=False)
    preprocess_to_store(cfg, with_a_second_job, warned.append)
    assert len(refused) == 1
    msg = refused[0]
    assert msg.startswith(f"--out {uri}: another mixlen preprocess is uploading to this prefix")
    assert f"host {host_tag()}, pid {os.getpid()}, started 20" in msg, msg
    assert f"delete {uri}/{CLAIM_FILE}" in msg
    local = corpus["tmp"] / "local"
    preprocess(PreprocessConfig(corpus["inputs"], str(local), progress=False))
    keys = _keys(s3, "two/ds/")
    assert CLAIM_FILE not in keys, "the claim is deleted once the manifest is up"
    assert keys == sorted(p.name for p in local.iterdir())
    for name in keys:
        if name != "manifest.json":  # (it names the store URI as --out)
            body = s3["client"].get_object(Bucket=s3["bucket"], Key=f"two/ds/{name}")["Body"]
            assert body.read() == (local / name).read_bytes(), name
    assert _manifest(s3, "two/ds/manifest.json")["args"]["inputs"] == corpus["inputs"]
    assert warned == []


def test_a_killed_jobs_claim_is_taken_over_on_its_host_only(
    s3, corpus, tmp_path, monkeypatch
) -> None:
    """A claim left by a killed upload of this host (its pid gone) is taken over at once, with
    a warning. Another host's recent claim cannot be checked: refused naming it, nothing
    uploaded, until it is deleted (or expires: below); so is one of a machine with this host's
    name and PID namespace (every Linux's first one has the same inode) but another boot id
    (before, taken over as if its process were gone here); a live process's claim of this host,
    or one whose pid is not a number, is refused too."""
    from datapipe import files

    with monkeypatch.context() as m:  # a twin: this name and namespace, another kernel's boot
        (tmp_path / "boot_id").write_text("0c4e1a2b-9d8f-4e6a-b1c2-d3e4f5a6b7c8\n")
        m.setattr(files, "BOOT_ID_FILE", str(tmp_path / "boot_id"))
        twin = host_tag()
    assert twin != host_tag() and twin.rsplit("_", 1)[0] == host_tag().rsplit("_", 1)[0]
    bucket = s3["bucket"]
    dead = {"id": "x", "host": host_tag(), "pid": _dead_pid(), "started": "2026-01-01T00:00:00"}
    _put_claim(s3, "dead/ds/", dead)
    warned: list[str] = []
    preprocess(PreprocessConfig(corpus["inputs"], f"s3://{bucket}/dead/ds", progress=False),
               warn=warned.append)  # fmt: skip
    assert any("took over the claim of a dead upload" in w and "its process is gone" in w
               for w in warned), warned  # fmt: skip
    assert "manifest.json" in _keys(s3, "dead/ds/") and CLAIM_FILE not in _keys(s3, "dead/ds/")

    for prefix, holder in {
        # another host's pid, dead here: means nothing here, so not taken over
        "far/ds/": {"id": "y", "host": "otherhost_1", "pid": dead["pid"], "started": "t0"},
        "twin/ds/": {"id": "v", "host": twin, "pid": dead["pid"], "started": "t0"},
        "live/ds/": {"id": "z", "host": host_tag(), "pid": os.getppid(), "started": "t"},
        "odd/ds/": {"id": "w", "host": host_tag(), "pid": "123x", "started": "t"},  # not a pid
    }.items():
        _put_claim(s3, prefix, holder)
        uri = f"s3://{bucket}/{prefix.rstrip('/')}"
        with pytest.raises(InputError, match=f"host {holder['host']}, pid {holder['pid']}, "
                           r"started .*, renewed \d+ s ago"):  # fmt: skip
            preprocess(PreprocessConfig(corpus["inputs"], uri, progress=False))
        assert _keys(s3, prefix) == [CLAIM_FILE], "nothing uploaded, the claim kept"
        assert (
            json.loads(
                s3["client"].get_object(Bucket=bucket, Key=prefix + CLAIM_FILE)["Body"].read()
            )
            == holder
        )
    s3["client"].delete_object(Bucket=bucket, Key="far/ds/" + CLAIM_FILE)  # as the message says
    preprocess(PreprocessConfig(corpus["inputs"], f"s3://{bucket}/far/ds", progress=False))
    assert "manifest.json" in _keys(s3, "far/ds/")


def test_a_claim_lost_mid_upload_stops_before_the_manifest(s3, corpus, monkeypatch) -> None:
    """The claim is taken by another job (deleted by hand and re-made) while this one uploads
    its shards: the manifest is not uploaded, so no dataset appears, and the other job's claim
    stays. A failed upload deletes its own claim."""
    from streaming.base.storage import upload as up

    bucket, uri = s3["bucket"], f"s3://{s3['bucket']}/lost/ds"
    other = {"id": "other", "host": "h", "pid": 2, "started": "t"}
    orig = up.S3Uploader.upload_file

    def upload_file(self, name):
        if name.startswith("shard.00000"):
            _put_claim(s3, "lost/ds/", other)
        return orig(self, name)

    monkeypatch.setattr(up.S3Uploader, "upload_file", upload_file)
    with pytest.raises(InputError, match="claim on the prefix was taken over while it uploaded"):
        preprocess(PreprocessConfig(corpus["inputs"], uri, progress=False))
    keys = _keys(s3, "lost/ds/")
    assert "manifest.json" not in keys and keys.count(CLAIM_FILE) == 1
    assert _manifest(s3, "lost/ds/" + CLAIM_FILE) == other, "another job's claim is not deleted"
    monkeypatch.setattr(up.S3Uploader, "upload_file", orig)

    def fails(local_cfg, warn):
        raise InputError("a bad input")

    with pytest.raises(InputError, match="a bad input"):
        preprocess_to_store(PreprocessConfig(corpus["inputs"], f"s3://{bucket}/bad/ds"), fails,
                            print)  # fmt: skip
    assert _keys(s3, "bad/ds/") == [], "the failed job's claim is deleted"


def _patched_puts(monkeypatch, change) -> None:
    """boto3 clients made from now on pass each PutObject's parameters through `change`."""
    import boto3

    real = boto3.client

    def client(*args, **kw):
        made = real(*args, **kw)
        made.meta.events.register(
            "before-parameter-build.s3.PutObject", lambda params, **_: change(params)
        )
        return made

    monkeypatch.setattr(boto3, "client", client)


@pytest.mark.parametrize("store", ["ignores", "refuses", "ignores-if-match"])
def test_a_store_without_conditional_writes_uploads_unclaimed(
    s3, corpus, monkeypatch, store
) -> None:
    """A store that ignores If-None-Match (it accepts the probe, a second claim over the first),
    that ignores If-Match (a put on another ETag), or that answers NotImplemented: the upload
    goes on without a claim, with a warning, and leaves no claim object behind."""
    from botocore.exceptions import ClientError

    def change(params: dict) -> None:
        conditional = "IfNoneMatch" in params or "IfMatch" in params
        if store.startswith("ignores"):
            params.pop("IfMatch", None)
            if store == "ignores":
                params.pop("IfNoneMatch", None)
        elif conditional:
            raise ClientError({"Error": {"Code": "NotImplemented", "Message": "no"}}, "PutObject")

    _patched_puts(monkeypatch, change)
    warned: list[str] = []
    uri = f"s3://{s3['bucket']}/{store}/ds"
    preprocess(PreprocessConfig(corpus["inputs"], uri, progress=False), warn=warned.append)
    assert [w for w in warned if "has no conditional writes" in w] == [
        f"{uri}/{CLAIM_FILE}: the store has no conditional writes ("
        + {
            "ignores": "it accepted a second claim over the first",
            "refuses": "it refused a conditional put",
            "ignores-if-match": "it accepted a put on another ETag",
        }[store]
        + "): this upload is not guarded against another one to the same prefix at the same moment"
    ]
    keys = _keys(s3, f"{store}/ds/")
    assert "manifest.json" in keys and CLAIM_FILE not in keys


def test_a_claim_is_renewed_and_expires(s3, corpus, monkeypatch) -> None:
    """The claim is renewed by a background put on its ETag (its LastModified moves on); a
    renewal that finds it taken marks the claim lost, which the next file's check reports. A
    claim of another host not renewed for STALE_S seconds (by the store's clock) is a dead job's:
    taken over, with a warning."""
    from datapipe.ingest import claim as claim_mod

    monkeypatch.setattr(claim_mod, "RENEW_S", 0.3)
    uri = f"s3://{s3['bucket']}/lease/ds"
    mine = PrefixClaim(uri)
    assert mine.acquire(print)
    key = "lease/ds/" + CLAIM_FILE
    first = s3["client"].head_object(Bucket=s3["bucket"], Key=key)["LastModified"]
    _until(lambda: s3["client"].head_object(Bucket=s3["bucket"], Key=key)["LastModified"] > first)
    # the claim rewritten with its own id (as a resent renewal may leave it, another ETag):
    # the renewal refused on its ETag finds it still ours, takes that ETag and goes on
    body = json.dumps(mine.body, indent=2)
    etag = s3["client"].put_object(Bucket=s3["bucket"], Key=key, Body=body)["ETag"]
    _until(lambda: mine.etag == etag)
    assert not mine.lost
    mine.check_renewals()
    mine.check()
    _put_claim(s3, "lease/ds/", {"id": "other", "host": "h", "pid": 3, "started": "t"})
    _until(lambda: mine.lost)
    with pytest.raises(InputError, match="was taken over while it uploaded"):
        mine.check_renewals()
    mine.release(print)
    assert _manifest(s3, key)["id"] == "other", "another job's claim is never deleted"

    monkeypatch.setattr(claim_mod, "STALE_S", 0.5)
    time.sleep(1.1)  # a whole second on the store's clock (Date and LastModified have seconds)
    warned: list[str] = []
    preprocess(PreprocessConfig(corpus["inputs"], uri, progress=False), warn=warned.append)
    assert any(w.startswith(f"{uri}/{CLAIM_FILE}: took over the claim of a dead upload (host h, "
                            "pid 3, started t: not renewed for ") for w in warned), warned  # fmt: skip
    assert CLAIM_FILE not in _keys(s3, "lease/ds/")


def _skew_this_host(monkeypatch, skew: float) -> None:
    """This process's clock (time.time) `skew` seconds off; the in-process moto server's Date
    header (http.server's, from time.time) stays on the true clock, as another machine's would."""
    import email.utils
    import http.server

    real = time.time

    def true_date(self, timestamp: float | None = None) -> str:
        return email.utils.formatdate(real() if timestamp is None else timestamp, usegmt=True)

    monkeypatch.setattr(http.server.BaseHTTPRequestHandler, "date_time_string", true_date)
    monkeypatch.setattr(time, "time", lambda: real() + skew)


def _until(done, timeout: float = 10.0) -> None:
    """Wait until `done()` (polled), failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_an_interrupted_claim_is_released(s3, corpus, monkeypatch) -> None:
    """Ctrl-C (or a store error) between the claim's put and its confirmation: the claim is
    deleted on the way out, so a rerun is not refused for STALE_S seconds."""

    def interrupted(self, warn):
        raise KeyboardInterrupt

    monkeypatch.setattr(PrefixClaim, "_confirm", interrupted)
    with pytest.raises(KeyboardInterrupt):
        preprocess(
            PreprocessConfig(corpus["inputs"], f"s3://{s3['bucket']}/int/ds", progress=False)
        )
    assert _keys(s3, "int/ds/") == []


@pytest.mark.parametrize("store", ["conditional", "no-conditional-deletes"])
def test_a_claim_taken_over_while_it_is_released_is_left(s3, store) -> None:
    """The release reads the claim, then deletes it on the ETag it read (`If-Match`): a claim
    taken over between the two is left to its new holder (before, a plain delete removed it, and
    a third upload could start beside the second). A store that answers NotImplemented to a
    conditional delete gets a plain one: the claim is gone."""
    from botocore.exceptions import ClientError

    prefix = f"race-{store}/ds/"
    mine = PrefixClaim(f"s3://{s3['bucket']}/{prefix}".rstrip("/"))
    assert mine.acquire(print)
    if store == "conditional":
        read = mine._read

        def read_then_taken(quick: bool = False):
            seen = read(quick)  # ours; then a successor takes the claim over
            _put_claim(s3, prefix, {"id": "next", "host": "h", "pid": 3, "started": "t"})
            return seen

        mine._read = read_then_taken  # type: ignore[method-assign]
    else:

        def refuse(params: dict, **_) -> None:
            if "IfMatch" in params:
                raise ClientError({"Error": {"Code": "NotImplemented"}}, "DeleteObject")

        mine.quick.meta.events.register("before-parameter-build.s3.DeleteObject", refuse)
    warned: list[str] = []
    mine.release(warned.append)
    assert warned == []
    if store == "conditional":
        assert _manifest(s3, prefix + CLAIM_FILE)["id"] == "next"
    else:
        assert _keys(s3, prefix) == []


def test_only_this_prefixs_killed_uploads_are_aborted(s3, corpus, monkeypatch) -> None:
    """Aborted: the unfinished multipart uploads under the prefix, not those of a sibling prefix
    that shares the name's start (the store's own listing). An upload aborts only those begun
    before it started (moto's Initiated is a fixed date, so the time it passes is checked
    against clocks read here; the store's clock: the next test); its staging copy is this user's
    only (0700)."""
    from datapipe.ingest import upload
    from datapipe.store import abort_multipart_uploads

    client, bucket = s3["client"], s3["bucket"]
    for key in ("sib/ds/shard.00000.mds", "sib/ds2/shard.00000.mds"):
        client.create_multipart_upload(Bucket=bucket, Key=key)
    n = abort_multipart_uploads(f"s3://{bucket}/sib/ds", print, time.monotonic() + 60)
    left = client.list_multipart_uploads(Bucket=bucket, Prefix="sib/").get("Uploads", [])
    assert n == 1 and [u["Key"] for u in left] == ["sib/ds2/shard.00000.mds"]
    seen: dict = {}

    def tokenize(local_cfg, warn):
        seen["mode"] = os.stat(os.path.dirname(local_cfg.out)).st_mode & 0o777
        seen["tokenizing"] = time.monotonic()
        return preprocess(local_cfg, warn)

    def spy(uri, warn, begun):
        seen["begun"] = begun
        return abort_multipart_uploads(uri, warn, begun)

    monkeypatch.setattr(upload, "abort_multipart_uploads", spy)
    cfg = PreprocessConfig(corpus["inputs"], f"s3://{bucket}/late/ds", progress=False)
    called = time.monotonic()
    preprocess_to_store(cfg, tokenize, print)
    assert called <= seen["begun"] <= seen["tokenizing"] and seen["mode"] == 0o700


@pytest.mark.parametrize("skew", [3600, -3600])
def test_killed_uploads_are_told_from_live_ones_on_the_stores_clock(s3, monkeypatch, skew):
    """This machine's clock an hour off the store's: of two unfinished uploads, the one begun
    two minutes before this job (which began 10 s ago) is aborted and the one begun a second ago
    is kept, judged by the store's Date header. (moto's Initiated is a fixed date: the listing's
    is set here, relative to that header, as the store would report it.)"""
    import email.utils

    import boto3

    from datapipe.store import abort_multipart_uploads

    client, bucket = s3["client"], s3["bucket"]
    for key in ("skew/ds/dead.mds", "skew/ds/live.mds"):
        client.create_multipart_upload(Bucket=bucket, Key=key)
    ago = {"skew/ds/dead.mds": 120.0, "skew/ds/live.mds": 1.0}

    def initiated(parsed, **_) -> None:
        now = email.utils.parsedate_to_datetime(parsed["ResponseMetadata"]["HTTPHeaders"]["date"])
        for up in parsed.get("Uploads", []):
            up["Initiated"] = now - datetime.timedelta(seconds=ago[up["Key"]])

    real_client = boto3.client

    def listing_client(*args, **kwargs):
        made = real_client(*args, **kwargs)
        made.meta.events.register("after-call.s3.ListMultipartUploads", initiated)
        return made

    monkeypatch.setattr(boto3, "client", listing_client)
    _skew_this_host(monkeypatch, skew)
    n = abort_multipart_uploads(f"s3://{bucket}/skew/ds", print, time.monotonic() - 10)
    left = client.list_multipart_uploads(Bucket=bucket, Prefix="skew/").get("Uploads", [])
    assert n == 1 and [u["Key"] for u in left] == ["skew/ds/live.mds"]


def test_a_claim_is_dead_only_when_its_process_is_gone_or_it_went_unrenewed() -> None:
    """A live job renews every RENEW_S seconds; one renewal late (or several missed) is not a
    dead job: only STALE_S seconds without a renewal, or its process gone on this host, is."""
    from datapipe.ingest import claim as claim_mod

    renew, stale = claim_mod.RENEW_S, claim_mod.STALE_S
    assert renew < stale
    elsewhere = {"host": "another-host", "pid": 1}
    for age in (0.0, renew + 1, 2 * renew, stale - 1, stale):  # dead only past STALE_S
        assert claim_mod._dead(elsewhere, age) is None, age
    assert claim_mod._dead(elsewhere, stale + 1) == f"not renewed for {stale + 1:.0f} s"
    here = {"host": host_tag(), "pid": os.getpid()}
    assert claim_mod._dead(here, 2 * renew) is None  # this process: alive
    gone = {"host": host_tag(), "pid": _dead_pid()}
    assert claim_mod._dead(gone, 0.0) == "its process is gone"


def test_a_claims_age_is_read_on_the_stores_clock(s3, monkeypatch) -> None:
    """This machine's clock an hour ahead of the store's (a host whose clock drifted): another
    host's claim written just now is alive by the store's Date header, so it is refused, not
    taken over as a dead job's."""
    _skew_this_host(monkeypatch, 3600)
    _put_claim(s3, "skew/ds/", {"id": "other", "host": "h", "pid": 3, "started": "t"})
    with pytest.raises(InputError, match=r"\(host h, pid 3, started t, renewed [0-9] s ago\)"):
        PrefixClaim(f"s3://{s3['bucket']}/skew/ds").acquire(print)
    assert _manifest(s3, "skew/ds/" + CLAIM_FILE)["id"] == "other"


def test_the_stores_clock_is_read_from_its_date_header(monkeypatch) -> None:
    """HTTP dates in GMT, "-0000" (UTC, no zone named) and an offset, in the reply layout
    boto3 gives, against the epoch seconds written out here, on a host whose local time is not
    UTC; no header, or one that is not a date, falls back to this host's clock."""
    from datapipe.store import store_clock as clock

    def store_clock(date: str | None) -> float:
        headers = {} if date is None else {"date": date}
        return clock({"ResponseMetadata": {"HTTPHeaders": headers}})

    at_three = 1796050800.0  # 2026-11-30 15:00:00 UTC
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        assert store_clock("Mon, 30 Nov 2026 15:00:00 GMT") == at_three
        assert store_clock("Mon, 30 Nov 2026 15:00:00 -0000") == at_three
        assert store_clock("Mon, 30 Nov 2026 16:00:00 +0100") == at_three
    finally:
        monkeypatch.undo()
        time.tzset()
    monkeypatch.setattr(time, "time", lambda: 42.0)
    assert store_clock(None) == store_clock("") == store_clock("yesterday") == clock({}) == 42.0
