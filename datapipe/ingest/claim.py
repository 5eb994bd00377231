"""One writer per s3:// prefix: `mixlen preprocess --out s3://...` claims the prefix before any
tokenizing, with a conditional put (`If-None-Match: *`) of `.mixlen-upload.json`, which the
store accepts for only one of two jobs starting at once. The claim names the job's host, process
id and start time; it is deleted once the manifest is uploaded, or when the run fails.

- A claim whose process is gone (SIGKILL, the OOM killer) on this same host is taken over by the
  next upload (a conditional put on the dead one's ETag, so two successors cannot both win).
- A claim from another host cannot be checked: the upload is refused, naming the job and the
  object to delete once that job is known to be dead.
- The claim is read back after each put and before the manifest goes up: a store that ignores
  conditional writes, or a claim deleted by hand while this job ran, is caught there.

Other schemes (gs://, oci://, ...) get no claim: the prefix is checked for a manifest before
tokenizing and again before uploading, which catches a job that finished meanwhile but not one
uploading at the same moment.
"""

from __future__ import annotations

import datetime
import json
import os
import urllib.parse
import uuid
from collections.abc import Callable

from datapipe.errors import InputError, StoreError
from datapipe.files import host_tag, pid_alive
from datapipe.store import error_code, scheme, store_error, with_retries

CLAIM_FILE = ".mixlen-upload.json"
_TAKEN = {"PreconditionFailed", "ConditionalRequestConflict"}  # 412, 409


class PrefixClaim:
    """This job's claim on an s3:// prefix (see the module docstring)."""

    def __init__(self, uri: str) -> None:
        import boto3

        parsed = urllib.parse.urlparse(uri)
        self.uri = uri.rstrip("/")
        self.bucket = parsed.netloc
        self.key = parsed.path.strip("/") + "/" + CLAIM_FILE
        self.url = f"{self.uri}/{CLAIM_FILE}"
        self.client = boto3.client("s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None)
        self.body = {
            "id": uuid.uuid4().hex,
            "host": host_tag(),
            "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        self.held = False

    def _put(self, **condition: str) -> bool:
        """Conditional put of the claim; False when the store says another one is there."""

        def put() -> bool:
            try:
                self.client.put_object(
                    Bucket=self.bucket,
                    Key=self.key,
                    Body=json.dumps(self.body).encode(),
                    **condition,
                )
            except Exception as exc:
                if error_code(exc) in _TAKEN:
                    return False
                raise
            return True

        return bool(with_retries(self.url, "write", put))

    def _read(self, attempts: int | None = None) -> tuple[dict, str] | None:
        """The claim in the store and its ETag, or None when there is none."""

        def get() -> tuple[dict, str] | None:
            try:
                got = self.client.get_object(Bucket=self.bucket, Key=self.key)
            except Exception as exc:
                err = store_error(self.url, exc, "read")
                if err is not None and err.kind == "not_found":
                    return None
                raise
            try:
                body = json.loads(got["Body"].read())
            except ValueError:
                body = {}
            return (body if isinstance(body, dict) else {}), got["ETag"]

        return with_retries(self.url, "read", get, attempts)  # type: ignore[return-value]

    def acquire(self, warn: Callable[[str], None]) -> None:
        """Claim the prefix, or raise InputError naming the job that holds it."""
        for _ in range(3):  # the claim may vanish between a refused put and its read
            if self._put(IfNoneMatch="*"):
                return self._confirm()
            seen = self._read()
            if seen is None:
                continue
            other, etag = seen
            if other.get("id") == self.body["id"]:  # our put landed; its reply was lost
                return self._confirm()
            if other.get("host") != host_tag() or pid_alive(int(other.get("pid") or 0) or -1):
                raise InputError(self._held_by(other))
            if self._put(IfMatch=etag):  # a dead job of this host's: take it over
                warn(
                    f"{self.url}: took over the claim of a killed upload (pid {other.get('pid')}, "
                    f"started {other.get('started')})"
                )
                return self._confirm()
        raise InputError(f"{self.url}: another upload keeps claiming this prefix; try again")

    def _confirm(self) -> None:
        """Read the claim back: a store that ignores conditional puts shows another job's."""
        seen = self._read()
        if seen is None or seen[0].get("id") != self.body["id"]:
            raise InputError(self._held_by(seen[0] if seen else {}, "; it replaced this job's"))
        self.held = True

    def check(self) -> None:
        """InputError unless the claim is still this job's (before the manifest goes up)."""
        seen = self._read()
        if seen is None or seen[0].get("id") != self.body["id"]:
            self.held = False
            gone = "was deleted" if seen is None else "was taken over"
            raise InputError(
                f"{self.url}: this job's claim on the prefix {gone} while it uploaded "
                f"({self._who(seen[0]) if seen else 'by hand?'}); the manifest was not uploaded, "
                "so no dataset is there: run again once no other upload to it is going"
            )

    def release(self, warn: Callable[[str], None]) -> None:
        """Delete the claim if it is still this job's; one try (this may run on the way out of a
        failed upload, the store unreachable): a failure only warns, and the next upload on this
        host takes the dead job's claim over."""
        if not self.held:
            return
        self.held = False
        try:
            seen = self._read(attempts=1)
            if seen is not None and seen[0].get("id") == self.body["id"]:
                with_retries(
                    self.url,
                    "write",
                    lambda: self.client.delete_object(Bucket=self.bucket, Key=self.key),
                    attempts=1,
                )
        except StoreError as exc:
            warn(f"{exc}: the upload's claim was left in place; delete {self.url} by hand")

    def _who(self, other: dict) -> str:
        return (
            f"host {other.get('host', '?')}, pid {other.get('pid', '?')}, started "
            f"{other.get('started', '?')}"
        )

    def _held_by(self, other: dict, extra: str = "") -> str:
        return (
            f"--out {self.uri}: another mixlen preprocess is uploading to this prefix "
            f"({self._who(other)}){extra}; wait for it to finish, or choose another --out. If "
            f"that job is dead (its machine lost), delete {self.url} and run again"
        )


def claim_prefix(uri: str, warn: Callable[[str], None]) -> PrefixClaim | None:
    """Claim an s3:// prefix for this upload (other schemes: None, no claim)."""
    if scheme(uri) != "s3":
        return None
    claim = PrefixClaim(uri)
    claim.acquire(warn)
    return claim
