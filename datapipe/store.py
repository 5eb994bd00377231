"""Object stores (s3://, gs://, oci://, azure://, hf://, ...) through mosaicml-streaming's own
upload and download code, with mixlen's errors and retries.

The library's own messages mislead (its downloader calls a refused request "not found", its
uploader's bucket check never shows its message), so errors are rebuilt here from the botocore
error code (or the SDK's exception name): access denied, no such bucket, no such object, store
unreachable, each naming the URI. A download or upload that cannot reach the store, or gets a
5xx, is retried with backoff (`MIXLEN_STORE_RETRIES` attempts, default 5), so a short outage of
the store is invisible to a training run. Endpoints and credentials come from the environment as
the library reads them (`S3_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` or
`AWS_PROFILE`, `GOOGLE_APPLICATION_CREDENTIALS`, ...).
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import os
import re
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager

from datapipe.errors import StoreError
from datapipe.files import dead_pid_paths, host_tag

RETRIES_ENV = "MIXLEN_STORE_RETRIES"
DEFAULT_RETRIES = 5
_DENIED = {
    "403",
    "AccessDenied",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "PermissionDenied",
    "Unauthenticated",
    "Unauthorized",
    "AuthenticationFailed",
    "AuthorizationFailure",
}
_NO_BUCKET = {"NoSuchBucket", "BucketNotFound", "ContainerNotFound"}
_NOT_FOUND = {"404", "NoSuchKey", "NotFound", "ResourceNotFoundError", "BlobNotFound"}
_TRANSIENT_CODES = {
    "500",
    "502",
    "503",
    "504",
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "Throttling",
}
_TRANSIENT_TYPES = {
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionError",
    "ServiceUnavailable",
    "TooManyRequests",
    "InternalServerError",
}
_CODE_IN_TEXT = re.compile(r"An error occurred \((\w+)\)")


def scheme(uri: str) -> str:
    """The URI's scheme (s3, gs, oci, ...)."""
    return urllib.parse.urlparse(uri).scheme


def upload_schemes() -> list[str]:
    """Schemes mosaicml-streaming's uploader knows (each may need its SDK installed)."""
    from streaming.base.storage.upload import UPLOADERS

    return sorted({k.split(":")[0] for k in UPLOADERS})


def error_code(exc: BaseException) -> str:
    """The store's error code: botocore's Error.Code, a code in the message, or the class name."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code:
            return str(code)
    m = _CODE_IN_TEXT.search(str(exc))
    if m:
        return m.group(1)
    return type(exc).__name__


def _endpoint() -> str:
    url = os.environ.get("S3_ENDPOINT_URL")
    return f" at {url}" if url else ""


def store_error(uri: str, exc: BaseException, doing: str) -> StoreError | None:
    """mixlen's error for a failed store call on `uri` (`doing`: "read", "write"), or None when
    `exc` is not a store error (a local file problem, a bug)."""
    if isinstance(exc, StoreError):
        return exc
    code = error_code(exc)
    names = {type(c).__name__ for c in _chain(exc)}
    bucket = urllib.parse.urlparse(uri).netloc
    creds = {
        "s3": "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE",
        "gs": "GOOGLE_APPLICATION_CREDENTIALS or GCS_KEY/GCS_SECRET",
        "azure": "AZURE_ACCOUNT_NAME/AZURE_ACCOUNT_ACCESS_KEY",
        "hf": "HF_TOKEN",
    }.get(scheme(uri), "the store's credentials")
    if code in _DENIED:
        return StoreError(
            f"{uri}: access denied ({code}): check the credentials in the environment ({creds}) "
            f"and that they may {doing} in {bucket!r}",
            "denied",
        )
    if code in _NO_BUCKET:
        return StoreError(f"{uri}: bucket {bucket!r} does not exist ({code})", "no_bucket")
    if code in _NOT_FOUND:
        return StoreError(
            f"{uri}: not found ({code}): no such object, or no bucket {bucket!r}", "not_found"
        )
    if "NoCredentialsError" in names:
        return StoreError(f"{uri}: no credentials found; set {creds}", "denied")
    if code in _TRANSIENT_CODES or names & _TRANSIENT_TYPES:
        return StoreError(
            f"{uri}: cannot reach the object store{_endpoint()} ({code}: {_first_line(exc)})",
            "unreachable",
        )
    if names & {"ClientError", "BotoCoreError", "S3UploadFailedError", "GoogleAPIError"}:
        return StoreError(
            f"{uri}: the object store refused to {doing} ({code}: {_first_line(exc)})"
        )
    if isinstance(exc, ValueError) and (
        "Unsupported remote path" in str(exc) or "Invalid Cloud" in str(exc)
    ):
        return StoreError(
            f"{uri}: scheme {scheme(uri)!r} is not supported; mosaicml-streaming handles "
            f"{', '.join(upload_schemes())}",
            "scheme",
        )
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    out = []
    seen: BaseException | None = exc
    while seen is not None and len(out) < 10:
        out.append(seen)
        seen = seen.__cause__ or seen.__context__
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _attempts() -> int:
    raw = os.environ.get(RETRIES_ENV, "")
    return max(1, int(raw)) if raw.isdigit() else DEFAULT_RETRIES


def with_retries(
    uri: str, doing: str, fn: Callable[[], object], attempts: int | None = None
) -> object:
    """Run `fn`; a store error becomes a StoreError, retried with backoff while transient (at
    most `attempts` tries; default MIXLEN_STORE_RETRIES)."""
    attempts = attempts or _attempts()
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as exc:
            err = store_error(uri, exc, doing)
            if err is None:
                raise
            if not err.transient or attempt + 1 == attempts:
                if attempts > 1 and err.transient:
                    err = StoreError(f"{err} (after {attempts} attempts)", err.kind)
                raise err from None
            time.sleep(min(0.5 * 2**attempt, 8.0))
    raise AssertionError("unreachable")


def import_downloader() -> None:
    """Import mosaicml-streaming's downloader (seconds, the first time in a process)."""
    from streaming.base.storage import CloudDownloader  # noqa: F401


# this thread's downloaders: (scheme, bucket, timeout) -> ((pid, environment), downloader)
_held = threading.local()


def _download_file(remote_file: str, local_file: str, timeout: float) -> None:
    """One file through this thread's mosaicml-streaming downloader for the URI's scheme and
    bucket, kept from file to file: the library's own `direct_download` makes an SDK client for
    each file (a boto3 client is ~0.1-0.3 s of CPU, with the GIL held). It is made again in a
    forked process, when the timeout or the environment (endpoint, credentials) changed, and
    after any failure."""
    from streaming.base.storage import CloudDownloader  # lazy: only remote datasets need it

    cache: dict = _held.__dict__.setdefault("downloaders", {})
    parsed = urllib.parse.urlparse(remote_file)
    key = (parsed.scheme, parsed.netloc, timeout)
    stamp = (os.getpid(), frozenset(os.environ.items()))
    held = cache.get(key)
    if held is None or held[0] != stamp:
        held = cache[key] = (stamp, CloudDownloader.get(remote_file))
    try:
        held[1].download(remote_file, local_file, timeout)
    except BaseException:
        cache.pop(key, None)  # the next try starts from a new client
        raise


def download(
    remote_file: str,
    local_file: str,
    timeout: float = 60.0,
    replace: bool = False,
    attempts: int | None = None,
) -> None:
    """Fetch one file with mosaicml-streaming's downloader into `local_file` (no-op when there,
    unless `replace`), through `local_file` + PART_TAG + HOST-PID-*, renamed into place in one
    step: other processes never find `local_file` missing or partial, and a download killed
    part-way leaves a file named by its process, which `remove_dead_parts` removes."""
    if os.path.exists(local_file) and not replace:
        return
    # a name of this download's own: ranks (and threads) that fetch one file at once never
    # write into, rename or remove each other's copy (the SDKs' own temporary names may be fixed)
    part = f"{local_file}{PART_TAG}{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with_retries(
            remote_file,
            "read",
            lambda: _download_file(remote_file, part, timeout),
            attempts,
        )
        os.replace(part, local_file)
    finally:
        if os.path.exists(part):
            os.remove(part)


PART_TAG = ".part-"


def remove_dead_parts(folder: str) -> int:
    """Remove the files in `folder` that downloads of this host's dead processes left (the
    SDK's own temporary names, beside or after `download`'s, included). Returns how many."""
    tag, n = f"{PART_TAG}{host_tag()}-", 0
    for parent, _, _ in os.walk(folder):  # shards may sit in subfolders (part-NNNNN/)
        for path in dead_pid_paths(parent, tag, anywhere=True):
            with contextlib.suppress(OSError):  # gone already, or not ours to remove
                os.remove(path)
                n += 1
    return n


def refresh_cache(
    remote_file: str, local_file: str, lock: Callable[[], AbstractContextManager]
) -> bool:
    """Fetch `remote_file` again on every open, over a cached copy `local_file`: when they differ
    (the dataset at that URI was deleted and written anew), every other file in the cached
    copy's folder is stale and removed. True when it was. A store that refuses or cannot be
    reached (no credentials on this node, an outage), or a full or read-only disk under the
    cache, leaves a cached copy in use (logged); with none, StoreError or OSError. The store is
    asked outside `lock` (the folder's, shared by the host's ranks), once where a copy is cached:
    an outage costs each rank one try at the same time, not retries one rank after another."""
    import filecmp
    import logging
    import shutil

    folder = os.path.dirname(local_file)
    mine = f".{os.path.basename(local_file)}."  # the fresh copies of the host's processes
    fresh = os.path.join(folder, f"{mine}{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    cached = os.path.exists(local_file)
    try:
        download(remote_file, fresh, attempts=1 if cached else None)
    except (StoreError, OSError) as exc:
        if os.path.exists(fresh):
            os.remove(fresh)
        if cached:  # unreachable, no credentials here, a full disk
            why = exc if isinstance(exc, StoreError) else f"{fresh}: {exc.strerror or exc}"
            logging.getLogger("mixlen").warning(f"{why}: reading the cached copy in {folder}")
            return False
        raise
    with lock():
        stale = os.path.exists(local_file) and not filecmp.cmp(local_file, fresh, shallow=False)
        if stale:  # the cached manifest goes last (replaced below): a cut-short cleanup is redone
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                if path == local_file or name.startswith(mine):
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)
            logging.getLogger("mixlen").warning(
                f"{remote_file} differs from the copy cached in {folder} (the dataset was "
                "written anew): the cached files were removed"
            )
        os.replace(fresh, local_file)
    return stale


def exists(remote_file: str) -> bool:
    """Whether `remote_file` exists (downloaded into a temporary file to find out)."""
    with tempfile.TemporaryDirectory(prefix="mixlen-probe-") as tmp:
        try:
            download(remote_file, os.path.join(tmp, "probe"))
        except StoreError as exc:
            if exc.kind == "not_found":
                return False
            raise
        except FileNotFoundError:  # a local-path "remote"
            return False
    return True


def open_uploader(uri: str, local: str):
    """mosaicml-streaming's uploader from `local` to `uri`; checks at once that the bucket exists
    and the credentials work (its constructor asks the store)."""
    from streaming.base.storage import CloudUploader

    if scheme(uri) not in upload_schemes():
        raise StoreError(
            f"{uri}: scheme {scheme(uri)!r} cannot be written; mosaicml-streaming uploads to "
            f"{', '.join(s + '://' for s in upload_schemes())}",
            "scheme",
        )
    try:
        return with_retries(
            uri,
            "write",
            lambda: CloudUploader.get((local, uri), keep_local=True, exist_ok=True, retry=1),
        )
    except StoreError as exc:
        if exc.kind != "not_found":
            raise
        bucket = urllib.parse.urlparse(uri).netloc  # the constructor's call is HeadBucket
        raise StoreError(f"{uri}: bucket {bucket!r} does not exist (404)", "no_bucket") from None


def store_clock(reply: dict) -> float:
    """The store's clock (seconds since the epoch) from an SDK reply's Date header; this
    machine's where it has none, or a bad one."""
    date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        when = email.utils.parsedate_to_datetime(date or "")
    except (TypeError, ValueError):
        return time.time()
    if when.tzinfo is None:  # "-0000": UTC, as HTTP dates are
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


def abort_multipart_uploads(uri: str, warn: Callable[[str], None], begun: float) -> int:
    """Abort the unfinished multipart uploads under the s3:// prefix `uri` begun before this job
    began (at the time.monotonic() reading `begun`), judged on the store's clock, not this
    host's: a killed upload's (the store keeps and bills their parts, and no later upload of the
    same key removes them); other schemes: nothing. Best effort: credentials that may not list or
    abort them get a warning, never a failed upload. Returns how many."""
    if scheme(uri) != "s3":
        return 0
    import boto3

    parsed = urllib.parse.urlparse(uri)
    bucket, prefix = parsed.netloc, parsed.path.lstrip("/").rstrip("/") + "/"
    client = boto3.client("s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None)

    def abort_all() -> int:
        n = 0
        pages = client.get_paginator("list_multipart_uploads").paginate(
            Bucket=bucket, Prefix=prefix
        )
        for page in pages:
            before = store_clock(page) - (time.monotonic() - begun)  # this job's start
            for up in page.get("Uploads", []):
                if up["Initiated"].timestamp() >= before:  # another job's, still running
                    continue
                client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
                n += 1
        return n

    try:
        n = int(with_retries(uri, "write", abort_all))  # type: ignore[call-overload]
    except StoreError as exc:
        warn(f"{exc}: unfinished multipart uploads under it (a killed upload's) were not checked")
        return 0
    if n:
        warn(f"{uri}: aborted {n} unfinished multipart upload(s) a killed upload had left")
    return n


def upload_files(
    uploader, uri: str, names: list[str], bar=None, before_each: Callable[[], None] | None = None
) -> None:
    """Upload `names` (paths relative to the uploader's local directory) in this order, calling
    `before_each` (which may raise) before each."""
    for name in names:
        if before_each is not None:
            before_each()
        target = uri.rstrip("/") + "/" + name
        with_retries(target, "write", lambda n=name: uploader.upload_file(n))
        if bar is not None:
            bar.update(os.path.getsize(os.path.join(uploader.local, name)))
