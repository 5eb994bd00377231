"""Downloading many small files from an object store: mosaicml-streaming's `direct_download` (an
SDK client made for every file, what datapipe.store.download did before) beside
datapipe.store.download (one client per thread and bucket, kept from file to file).

moto's S3 server on 127.0.0.1 (a free port, started and stopped here, nothing else reached); N
objects of B bytes; each way downloads every object once into a fresh folder, the two ways
interleaved over the repeats; the figures are the best repeat's wall and this process's CPU
(user + system, moto's server thread included: the same for both ways) per file, and their ratio.

usage: .venv/bin/python benchmarks/bench_store.py [--files 100] [--bytes 65536] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(fetch: Callable[[str, str], None], uris: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of fetching every URI into a fresh folder."""
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        w0, c0 = time.perf_counter(), _cpu()
        for i, uri in enumerate(uris):
            fetch(uri, os.path.join(tmp, f"f{i}"))
        return time.perf_counter() - w0, _cpu() - c0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=100)
    ap.add_argument("--bytes", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import boto3
    from moto.server import ThreadedMotoServer
    from streaming.base.storage import CloudDownloader

    from datapipe.store import download

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "S3_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    os.environ.update(env)
    try:
        client = boto3.client("s3", endpoint_url=env["S3_ENDPOINT_URL"])
        client.create_bucket(Bucket="bench")
        body = os.urandom(args.bytes)
        for i in range(args.files):
            client.put_object(Bucket="bench", Key=f"d/{i:05d}", Body=body)
        uris = [f"s3://bench/d/{i:05d}" for i in range(args.files)]
        ways = {
            "direct_download (a client per file)": lambda u, p: CloudDownloader.direct_download(
                u, p, 60.0
            ),
            "datapipe.store.download (kept)": lambda u, p: download(u, p),
        }
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.repeats):
            for name, fetch in ways.items():
                wall, cpu = _timed(fetch, uris)
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, cpu)
    finally:
        server.stop()
    print(f"{args.files} files of {args.bytes} bytes from moto's S3 server on 127.0.0.1, best of "
          f"{args.repeats}\n")  # fmt: skip
    print("| way | wall ms/file | CPU ms/file |")
    print("| --- | ---: | ---: |")
    for name, (wall, cpu) in best.items():
        print(f"| {name} | {1e3 * wall / args.files:.1f} | {1e3 * cpu / args.files:.1f} |")
    (w_old, c_old), (w_new, c_new) = best.values()
    print(f"\nkept client: {w_old / w_new:.1f}x less wall, {c_old / c_new:.1f}x less CPU per file")


if __name__ == "__main__":
    main()
