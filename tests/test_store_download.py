"""datapipe.store.download against moto's S3 server on 127.0.0.1: one SDK client per thread for
the files of a bucket (mosaicml-streaming's own `direct_download` made one per file), made again
for another bucket or timeout, in a forked process, when the environment changes or after a
failure; the bytes are the ones boto3 put there."""

from __future__ import annotations

import os
import select
import threading

import pytest

from datapipe.errors import StoreError
from datapipe.store import download

pytest.importorskip("moto.server", reason="moto[s3] is a test-only dependency (.[dev])")

pytestmark = pytest.mark.timeout(120)


def test_one_client_per_thread_made_again_on_a_new_environment_or_a_failure(
    s3, tmp_path, monkeypatch
) -> None:
    from streaming.base.storage.download import S3Downloader

    made: list[int] = []
    create = S3Downloader._create_s3_client

    def counted(self, *args, **kwargs):
        made.append(threading.get_ident())
        return create(self, *args, **kwargs)

    monkeypatch.setattr(S3Downloader, "_create_s3_client", counted)
    bucket, client = s3["bucket"], s3["client"]
    body = {f"f{i}": bytes(range(i, i + 50)) * (i + 1) for i in range(4)}
    for name, data in body.items():
        client.put_object(Bucket=bucket, Key=f"d/{name}", Body=data)

    def fetch(name: str, into: str, where: str = bucket, **kw: float) -> bytes:
        download(f"s3://{where}/d/{name}", str(tmp_path / into), **kw)
        return (tmp_path / into).read_bytes()

    for name in body:  # four files, one client
        assert fetch(name, f"a-{name}") == body[name]
    assert len(made) == 1
    monkeypatch.setenv("MIXLEN_TEST_SOMETHING_ELSE", "1")  # another environment: a new client
    assert fetch("f1", "b-f1") == body["f1"]
    assert len(made) == 2
    with pytest.raises(StoreError, match="not found"):
        fetch("missing", "c-missing")
    assert len(made) == 2 and not (tmp_path / "c-missing").exists()
    assert fetch("f2", "c-f2") == body["f2"]  # the failure dropped the client: a new one
    assert len(made) == 3
    got: list[bytes] = []
    worker = threading.Thread(target=lambda: got.append(fetch("f3", "d-f3")))
    worker.start()
    worker.join(60)
    assert got == [body["f3"]] and len(made) == 4 and made[-1] != made[0]
    assert fetch("f0", "e-f0") == body["f0"] and len(made) == 4  # this thread's is kept
    other = bucket + "-2"  # another bucket: its own client, this bucket's kept
    client.create_bucket(Bucket=other)
    client.put_object(Bucket=other, Key="d/g", Body=b"other")
    assert fetch("g", "f-g", other) == b"other" and len(made) == 5
    assert fetch("f1", "f-f1") == body["f1"] and len(made) == 5
    assert fetch("f2", "g-f2", timeout=30.0) == body["f2"] and len(made) == 6  # another timeout
    assert _in_child(lambda: (fetch("f3", "h-f3"), len(made))[1]) == 7  # a forked process
    assert fetch("f3", "i-f3") == body["f3"] and len(made) == 6


def _in_child(fn) -> int:
    """fn() run in a forked child of this process, its result (an int) read back."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.write(w, str(fn()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 60)
        out = os.read(r, 64) if ready else b""
    finally:
        os.close(r)
        if not out:
            os.kill(pid, 9)
        _, status = os.waitpid(pid, 0)
    assert out and status == 0, (out, status)
    return int(out)
