"""`mixlen preprocess --out s3://bucket/prefix` (or gs://, oci://, ...): the dataset is written to a
local staging directory exactly as for a local `--out`, then uploaded with mosaicml-streaming's
uploader: shards, then the indexes, then `manifest.json` last, so a reader (which starts from the
manifest) never sees a half-uploaded dataset.

Before any tokenizing, the uploader checks that the bucket exists and the credentials work, and a
prefix that already holds a manifest is refused: mixlen never replaces objects under a dataset
someone may be reading (readers cache a remote dataset's files by URI, which is sound only if
what is at a URI never changes). A failed upload leaves no manifest, so no dataset. On s3:// the
prefix is then claimed for this job (datapipe.ingest.claim), so two uploads to one prefix at once
cannot interleave their shards.

The staging directory is `mixlen-stage-HOST-PID-*` under `--staging` (default: the temp directory),
removed at the end, on an error, Ctrl-C or SIGTERM; one a killed run left (SIGKILL, the OOM
killer) is removed by the next upload on the same host that finds its process gone.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from datapipe.errors import InputError, MixlenError
from datapipe.files import host_tag, remove_dead_pid_dirs
from datapipe.index import INDEX_FILE, MANIFEST_FILE
from datapipe.ingest.claim import PrefixClaim, claim_prefix
from datapipe.ingest.output import SigtermAsInterrupt
from datapipe.progress import progress
from datapipe.store import abort_multipart_uploads, exists, open_uploader, upload_files


def dataset_files(root: str, manifest: dict) -> list[str]:
    """A dataset's files relative to `root`, in upload order: shards, MDS index.json,
    index.parquet, manifest.json last."""
    names = [s["name"] for s in manifest["shards"]]
    if os.path.exists(os.path.join(root, "index.json")):
        names.append("index.json")
    return [*names, INDEX_FILE, MANIFEST_FILE]


STAGE_PREFIX = "mixlen-stage-"


def remove_dead_stages(parent: str, warn: Callable[[str], None]) -> None:
    """Remove the staging directories in `parent` of this host's uploads that were killed."""
    for path in remove_dead_pid_dirs(parent, f"{STAGE_PREFIX}{host_tag()}-"):
        warn(f"removed {path}, a killed upload's staging copy")


def preprocess_to_store(cfg, preprocess: Callable, warn: Callable[[str], None]):
    """Run `preprocess` into a staging directory, then upload the dataset to `cfg.out`."""
    with SigtermAsInterrupt():  # the staging copy is removed on SIGTERM too
        return _stage_and_upload(cfg, preprocess, warn)


def _refuse_a_dataset(out: str, meanwhile: str = "") -> None:
    """InputError when the prefix holds a dataset (checked first, and again before uploading:
    another job may have finished one there while this one tokenized)."""
    if exists(f"{out.rstrip('/')}/{MANIFEST_FILE}"):
        raise InputError(
            f"--out {out}: already holds a dataset ({MANIFEST_FILE}); {meanwhile}mixlen does not "
            "replace a dataset in an object store (readers may be using it; --overwrite is "
            "for local directories): choose another prefix, or delete the old one first"
        )


def _stage_and_upload(cfg, preprocess: Callable, warn: Callable[[str], None]):
    uri, begun = cfg.out.rstrip("/"), time.monotonic()
    parent = cfg.staging or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    remove_dead_stages(parent, warn)
    stage = os.path.join(parent, f"{STAGE_PREFIX}{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(stage, 0o700)  # the tokenized corpus: this user's only, as mkdtemp made it
    claim: PrefixClaim | None = None
    try:
        uploader = open_uploader(uri, os.path.join(stage, "dataset"))  # bucket + credentials
        _refuse_a_dataset(cfg.out)
        claim = claim_prefix(uri, warn)  # one upload per prefix at a time (s3://)
        t0 = time.perf_counter()
        # (the uploader made the empty local directory: the local run replaces it)
        staged = os.path.join(stage, "dataset")
        try:
            res = preprocess(replace(cfg, out=staged, overwrite=True), warn)
        except MixlenError as exc:  # a full disk under the staging copy: name the user's flag
            if f"--out {staged}" not in str(exc):
                raise
            where = f"--staging {parent} (the local copy of --out {cfg.out} before its upload)"
            raise type(exc)(str(exc).replace(f"--out {staged}", where)) from None
        root = res.out
        manifest = res.manifest
        manifest["args"]["out"] = cfg.out  # where the dataset lives, not the staging directory
        tmp = os.path.join(root, MANIFEST_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, os.path.join(root, MANIFEST_FILE))
        names = dataset_files(root, manifest)
        total = sum(os.path.getsize(os.path.join(root, n)) for n in names)
        _refuse_a_dataset(cfg.out, "was written there while this run tokenized; ")
        abort_multipart_uploads(uri, warn, begun)  # a killed upload's parts, still billed
        with progress(total, "upload", "B", cfg.progress, unit_scale=True) as bar:
            if claim is not None:
                claim.check()
            before = claim.check_renewals if claim is not None else None
            upload_files(uploader, uri, names[:-1], bar, before)
            if claim is not None:
                claim.check()  # still ours: then the manifest makes it a dataset
            upload_files(uploader, uri, names[-1:], bar)
        res.out = uri
        res.seconds = time.perf_counter() - t0
        return res
    finally:
        try:
            if claim is not None:
                claim.release(warn)
        finally:  # (even if a second Ctrl-C cuts the release short)
            shutil.rmtree(stage, ignore_errors=True)
