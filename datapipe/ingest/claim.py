"""One writer per s3:// prefix: `mixlen preprocess --out s3://...` claims the prefix before any
tokenizing, with a conditional put (`If-None-Match: *`) of `.mixlen-upload.json`, which the
store accepts for only one of two jobs starting at once. The claim names the job's host, process
id and start time; it is a lease, renewed every RENEW_S seconds by a background thread (a put on
its own ETag), and deleted once the manifest is uploaded or the run fails (a delete on the ETag
read, `If-Match`, which leaves a claim taken over meanwhile to its new holder).

- A claim is a dead job's, and taken over by the next upload (a put on the dead one's ETag, so
  two successors cannot both win), when its process is gone on this same host (the same name,
  PID namespace and boot: files.host_tag), or when it was not renewed for STALE_S seconds by the store's own clock (a job
  killed on another node, or in a container since restarted). A live job's is refused, naming it.
- The claim is read back after it is made; the renewals notice a claim taken away, and it is
  checked before the first file and before the manifest goes up: a claim lost meanwhile stops
  the upload with no manifest, so no dataset.
- A store without conditional writes (it answers NotImplemented, or accepts a second
  `If-None-Match: *` put of an existing key) gets no claim, with a warning: the upload goes on
  as for other schemes.

Other schemes (gs://, oci://, ...) get no claim: the prefix is checked for a manifest before
tokenizing and again before uploading, which catches a job that finished meanwhile but not one
uploading at the same moment.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import urllib.parse
import uuid
from collections.abc import Callable

from datapipe.errors import InputError, StoreError
from datapipe.files import host_tag, pid_alive
from datapipe.store import error_code, scheme, store_clock, store_error, with_retries

CLAIM_FILE = ".mixlen-upload.json"
RENEW_S = 60.0  # how often a claim is renewed
STALE_S = 600.0  # a claim not renewed for this long is a dead job's
_TAKEN = {"PreconditionFailed", "ConditionalRequestConflict"}  # 412, 409
_GONE = {"NoSuchKey", "404", "NotFound"}  # a put on an ETag whose object was deleted
_UNSUPPORTED = {"NotImplemented", "ParamValidationError"}  # no conditional writes (or botocore)


class PrefixClaim:
    """This job's claim on an s3:// prefix (see the module docstring)."""

    def __init__(self, uri: str) -> None:
        import boto3
        from botocore.config import Config

        parsed = urllib.parse.urlparse(uri)
        self.uri = uri.rstrip("/")
        self.bucket = parsed.netloc
        self.key = parsed.path.strip("/") + "/" + CLAIM_FILE
        self.url = f"{self.uri}/{CLAIM_FILE}"
        endpoint = os.environ.get("S3_ENDPOINT_URL") or None
        self.client = boto3.client("s3", endpoint_url=endpoint)
        # the release runs on the way out of a failed run (the store may be down): one quick try
        quick = Config(retries={"max_attempts": 1}, connect_timeout=5, read_timeout=10)
        self.quick = boto3.client("s3", endpoint_url=endpoint, config=quick)
        self.body = {
            "id": uuid.uuid4().hex,
            "host": host_tag(),
            "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        self.etag = ""
        self.held = False
        self.lost = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _put(self, quick: bool = False, **condition: str) -> str:
        """Conditional put of the claim: "ok", "taken" (another one is there, or another ETag),
        "gone" (no object for an If-Match) or "unsupported" (no conditional writes). `quick`:
        one try on the quick client (the renewals: the next one tries again)."""
        client = self.quick if quick else self.client

        def put() -> str:
            try:
                got = client.put_object(
                    Bucket=self.bucket,
                    Key=self.key,
                    Body=json.dumps(self.body).encode(),
                    **condition,
                )
            except Exception as exc:
                code = error_code(exc)
                for codes, said in (
                    (_TAKEN, "taken"),
                    (_GONE, "gone"),
                    (_UNSUPPORTED, "unsupported"),
                ):
                    if code in codes:
                        return said
                raise
            self.etag, self.held = got.get("ETag", ""), True  # ours: released from now on
            return "ok"

        return str(with_retries(self.url, "write", put, 1 if quick else None))

    def _read(self, quick: bool = False) -> tuple[dict, str, float] | None:
        """The claim in the store, its ETag and its age by the store's clock (seconds since it
        was written or renewed), or None when there is none."""
        client = self.quick if quick else self.client

        def get() -> tuple[dict, str, float] | None:
            try:
                got = client.get_object(Bucket=self.bucket, Key=self.key)
            except Exception as exc:
                err = store_error(self.url, exc, "read")
                if err is not None and err.kind == "not_found":
                    return None
                raise
            try:  # (a claim is a few hundred bytes: anything else is not one)
                body = json.loads(got["Body"].read(1 << 16))
            except ValueError:
                body = {}
            now = store_clock(got)
            age = max(0.0, now - got["LastModified"].timestamp())
            return (body if isinstance(body, dict) else {}), got["ETag"], age

        return with_retries(self.url, "read", get, 1 if quick else None)  # type: ignore[return-value]

    def acquire(self, warn: Callable[[str], None]) -> bool:
        """Claim the prefix (True), find the store cannot hold a claim (False, warned), or raise
        InputError naming the live job that holds it."""
        for _ in range(4):  # the claim may vanish or change between our calls
            said = self._put(IfNoneMatch="*")
            if said == "unsupported":
                return self._unsupported(warn, "it refused a conditional put")
            if said == "ok":
                return self._confirm(warn)
            seen = self._read()
            if seen is None:
                continue
            other, etag, age = seen
            if other.get("id") == self.body["id"]:  # our put landed; its reply was lost
                return self._confirm(warn)
            why = _dead(other, age)
            if why is None:
                raise InputError(self._held_by(other, age))
            said = self._put(IfMatch=etag)
            if said == "unsupported":
                return self._unsupported(warn, "it refused a conditional put")
            if said == "ok":
                warn(f"{self.url}: took over the claim of a dead upload ({_who(other)}: {why})")
                return self._confirm(warn)
        raise InputError(f"{self.url}: other uploads keep claiming this prefix; try again")

    def _confirm(self, warn: Callable[[str], None]) -> bool:
        """Read the claim back; check that the store honours the conditions (a second claim
        refused, a renewal on our ETag taken and one on another refused); start renewing."""
        seen = self._read()
        if seen is None or seen[0].get("id") != self.body["id"]:
            self.held = False  # (not ours to delete)
            other, age = (seen[0], seen[2]) if seen else ({}, 0.0)
            raise InputError(self._held_by(other, age, "; it replaced this job's"))
        probes = (
            ({"IfNoneMatch": "*"}, "taken", "it accepted a second claim over the first"),
            ({"IfMatch": '"0"'}, "taken", "it accepted a put on another ETag"),
            ({"IfMatch": seen[1]}, "ok", "it refused a put on the claim's own ETag"),
        )
        for condition, want, why in probes:
            said = self._put(**condition)
            if said != want:
                self._delete(warn)
                return self._unsupported(
                    warn, "it refused a conditional put" if said == "unsupported" else why
                )
        self._renewer = threading.Thread(target=self._renew, name="mixlen-claim", daemon=True)
        self._renewer.start()
        return True

    def _unsupported(self, warn: Callable[[str], None], why: str) -> bool:
        warn(
            f"{self.url}: the store has no conditional writes ({why}): this upload is not "
            "guarded against another one to the same prefix at the same moment"
        )
        return False

    def _renew(self) -> None:
        """Renew the claim every RENEW_S seconds until released; a claim found to be another
        job's marks it lost (a refused renewal whose claim is still ours, as a resent request
        may be, only takes the stored ETag)."""
        while not self._stop.wait(RENEW_S):
            try:
                said = self._put(quick=True, IfMatch=self.etag)
                if said == "ok":
                    continue
                seen = self._read(quick=True)
            except StoreError:  # the store unreachable for now: the next renewal tries again
                continue
            if seen is not None and seen[0].get("id") == self.body["id"]:
                self.etag = seen[1]
                continue
            self.lost = True
            return

    def check(self) -> None:
        """InputError unless the claim is still this job's (before the first file and the
        manifest; cheaply, from the renewals' view, before each other file)."""
        seen = self._read()
        if seen is None or seen[0].get("id") != self.body["id"]:
            self.lost = True
            taken = seen is not None and seen[0].get("id") != self.body["id"]
            gone = "was taken over" if taken else "was lost"
            raise InputError(
                f"{self.url}: this job's claim on the prefix {gone} while it uploaded "
                f"({_who(seen[0]) if taken else 'deleted, or taken by another job'}); the "
                "manifest was not uploaded, so no dataset is there: run again once no other "
                "upload to it is going"
            )

    def check_renewals(self) -> None:
        """InputError if a renewal found the claim taken (no store call)."""
        if self.lost:
            self.check()

    def release(self, warn: Callable[[str], None]) -> None:
        """Stop renewing; delete the claim if it is still this job's. One quick try (this may run
        on the way out of a failed upload, the store unreachable): a failure only warns, and
        the claim expires after STALE_S seconds."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(5)
        if self.held:
            self._delete(warn)

    def _delete(self, warn: Callable[[str], None]) -> None:
        """Delete the claim if the store still holds this job's: a delete on the ETag read
        (`If-Match`), so a claim taken over between the read and the delete is left to its new
        holder; a store without conditional deletes gets a plain one."""
        self.held = False
        try:
            seen = self._read(quick=True)
            if seen is not None and seen[0].get("id") == self.body["id"]:
                with_retries(self.url, "write", lambda: self._delete_on(seen[1]), attempts=1)
        except StoreError as exc:
            warn(
                f"{exc}: the upload's claim was left; it expires {STALE_S:.0f} s after its last renewal"
            )

    def _delete_on(self, etag: str) -> None:
        try:
            self.quick.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=etag)
        except Exception as exc:
            code = error_code(exc)
            if code in _TAKEN or code in _GONE:  # replaced or deleted since it was read
                return
            if code not in _UNSUPPORTED:
                raise
            self.quick.delete_object(Bucket=self.bucket, Key=self.key)

    def _held_by(self, other: dict, age: float, extra: str = "") -> str:
        return (
            f"--out {self.uri}: another mixlen preprocess is uploading to this prefix "
            f"({_who(other)}, renewed {age:.0f} s ago){extra}; wait for it to finish, or choose "
            f"another --out. A claim not renewed for {STALE_S:.0f} s is a dead job's and is "
            f"taken over; to take it at once, delete {self.url}"
        )


def _who(other: dict) -> str:
    return (
        f"host {other.get('host', '?')}, pid {other.get('pid', '?')}, started "
        f"{other.get('started', '?')}"
    )


def _dead(other: dict, age: float) -> str | None:
    """Why the job of claim `other` (last written `age` seconds ago) is dead, or None."""
    pid = other.get("pid")
    if other.get("host") == host_tag() and isinstance(pid, int) and pid > 0 and not pid_alive(pid):
        return "its process is gone"
    if age > STALE_S:
        return f"not renewed for {age:.0f} s"
    return None


def claim_prefix(uri: str, warn: Callable[[str], None]) -> PrefixClaim | None:
    """Claim an s3:// prefix for this upload (other schemes, or a store without conditional
    writes: None, no claim). A claim made by a failed acquire is released."""
    if scheme(uri) != "s3":
        return None
    claim = PrefixClaim(uri)
    try:
        held = claim.acquire(warn)
    except BaseException:
        claim.release(warn)
        raise
    return claim if held else None
