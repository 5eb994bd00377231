"""moto's S3 server for the store tests: on 127.0.0.1 at a free port, started and stopped by the
test module, with credentials set in the environment by the test. Its fixtures `server` and `s3`
reach every test module as a plugin (tests/conftest.py); moto is imported only when one is used."""

from __future__ import annotations

import logging
import os

import pytest

KEY, SECRET = "mixlen-test-key", "mixlen-test-secret"


class Server:
    """moto's S3 server in a thread of this process; its buckets and objects live in this
    process, so they survive a stop/start on the same port. Starting waits at most
    START_TIMEOUT_S (moto's own start waits forever when its thread cannot bind the port), and
    starting a running server does nothing (a test's cleanup may restart one it never
    stopped)."""

    START_TIMEOUT_S = 30.0

    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.running = False
        self._start(0)
        self.host, self.port = self._srv.get_host_and_port()
        self.url = f"http://{self.host}:{self.port}"

    def _start(self, port: int) -> None:
        import threading

        from moto import server as moto_server

        self._srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        starting = threading.Thread(target=self._srv.start, daemon=True)
        starting.start()
        starting.join(self.START_TIMEOUT_S)
        if starting.is_alive():
            raise RuntimeError(f"moto's S3 server did not start on 127.0.0.1:{port}")
        self.running = True

    def stop(self) -> None:
        if self.running:
            self._srv.stop()
            self.running = False

    def start(self) -> None:
        if not self.running:
            self._start(self.port)


def s3_env(server: Server, monkeypatch, tmp_path) -> dict:
    """Point boto3 (and so mosaicml-streaming) at the server, nothing else; a new bucket.
    Returns the bucket's name, a client and the server."""
    for k, v in {
        "S3_ENDPOINT_URL": server.url,
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
        "MIXLEN_STORE_RETRIES": "1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    client = s3_client(server.url, KEY, SECRET)
    bucket = f"b{tmp_path.name[-12:].lower().replace('_', '-')}".strip("-")
    client.create_bucket(Bucket=bucket)
    return {"client": client, "bucket": bucket, "server": server}


def s3_client(url: str, key: str, secret: str):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        region_name="us-east-1",
    )


@pytest.fixture(scope="module")
def server():
    """The server, one per test module that uses it."""
    srv = Server()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def s3(server, monkeypatch, tmp_path) -> dict:
    """A new bucket on the module's server, the environment pointing at it (s3_env)."""
    return s3_env(server, monkeypatch, tmp_path)
