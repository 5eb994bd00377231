"""`mixlen preprocess --engine ray`: the same dataset as the local engine, built by Ray Data tasks.

Every storage row carries its global sample id (docs/FORMAT.md), and a task cannot know its first id
before all earlier inputs are tokenized (empty documents, bad records and `--long-docs split`
change the count), so the run has two stages over the inputs in their fixed sorted order, cut
into groups of consecutive files:

1. tokenize: one task per group reads and tokenizes its files with the local engine's own reader
   and tokenizer (datapipe.ingest.sources) and spills tokens, lengths and sources to the run's
   temporary directory; it returns counts only.
2. write: once the driver has each group's first sample id (a prefix sum), one task per group
   writes `part-NNNNN/` with the format's own writer, plus that part's index (`index.parquet`,
   `shards.json`).

The driver merges: MDS `index.json` files with mosaicml-streaming's `merge_index` over the
explicit sorted list of parts, index parts concatenated in input order with shard numbers offset.
Shard boundaries differ from the local engine's; sample ids, tokens, sources and the index do
not (the parts' layout and merge: ray_parts.py). A task's failure comes back as data naming the
input file, and the run fails before anything is renamed into place. A task whose worker process
dies is run again by Ray in another worker, up to TASK_TRIES times; every task can be (stage 1
rewrites its spill; stage 2 starts its part folder afresh, or finds it complete when only its
return was cut short). On a cluster (`--ray-address`), inputs, the tokenizer file and `--out`'s
parent directory must be on a filesystem every node sees.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from datapipe.errors import InputError, MixlenError
from datapipe.formats import build_writer
from datapipe.index import INDEX_FILE
from datapipe.ingest import sources, worker
from datapipe.ingest.engines.base import (
    NOTE_COUNTS,
    EngineResult,
    EngineRun,
    write_metadata,
)
from datapipe.ingest.engines.ray_parts import merge_parts, part_dir
from datapipe.ingest.worker import BLOCK_COUNT_KEYS
from datapipe.progress import input_sizes, progress

TASK_BYTES = 64 << 20  # most input bytes per tokenize task
MIN_TASKS = 64  # about this many tasks for inputs under 64 x TASK_BYTES (not per worker: the
# groups, so the shards, must not depend on --workers)
FAIL_HOOK_ENV = "MIXLEN_TEST_RAY_FAIL_ON"  # test-only: a task raises on a file containing this
# test-only: a folder; the first write task to find ARM there renames it FIRED and kills its
# worker process at the point ARM names: "shards" (its shards written, not its index) or "done"
# (its part complete and its spill removed, the task not returned); Ray retries the task in a
# new worker. A file ALWAYS there holding a name: a tokenize task kills its worker on every
# input of that name
KILL_HOOK_ENV = "MIXLEN_TEST_RAY_KILL_IN"
SPILL_DIR = ".spill"
TASK_TRIES = 4  # runs of a task whose worker process dies, before the run fails


@dataclass(frozen=True)
class Job:
    """What every task of one run needs (pickled into the tasks)."""

    settings: sources.TokenizeSettings
    root: str  # the run's temporary output directory
    format: str
    dtype: str
    chunk_tokens: int
    shard_bytes: int
    strict: bool
    max_reported: int


def task_groups(files: list[Path]) -> list[list[str]]:
    """Consecutive input files cut into groups: a group closes once it holds 1/MIN_TASKS of the
    input bytes (at most TASK_BYTES), so about MIN_TASKS groups of files of similar sizes."""
    sizes = input_sizes(files)
    total = sum(sizes.values())
    target = max(1, min(TASK_BYTES, total // MIN_TASKS))
    groups: list[list[str]] = []
    cur: list[str] = []
    cur_bytes = 0
    for f in files:
        cur.append(str(f))
        cur_bytes += sizes[str(f)]
        if cur_bytes >= target:
            groups.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        groups.append(cur)
    return groups


# --- tasks (run in Ray workers) -------------------------------------------------------------------


def _spill_base(root: str, idx: int) -> str:
    return os.path.join(root, SPILL_DIR, f"{idx:05d}")


class _Trace:
    """Where a task is, noted in the spill folder before it is read: each try of the task (a
    byte in `.tries`) and the input being read (`at`, also in `.at`), so that the driver can
    name the input of a task whose worker died on every try without a word (the OOM killer)."""

    def __init__(self, base: str, stage: str, at: str) -> None:
        self.path = f"{base}.{stage}"
        with open(self.path + ".tries", "ab") as f:
            f.write(b".")
        self.set(at)

    def set(self, at: str) -> None:
        self.at = at
        with open(self.path + ".at", "w") as f:
            f.write(at)


def _tokenize_group(job: Job, paths: list[str], spill, out: dict, trace: _Trace) -> None:
    """Tokenize the files in order, spilling tokens to `spill` and collecting into `out`;
    `trace` follows the input being read (for a failure's message)."""
    fail_on = os.environ.get(FAIL_HOOK_ENV)
    notes: list[tuple[str, str, str]] = []
    note_counts: dict[str, int] = {}
    counts = dict.fromkeys(BLOCK_COUNT_KEYS, 0)
    for block in sources.iter_blocks([Path(p) for p in paths], job.settings):
        trace.set(block.where())
        files = block.items if block.kind == "text" else [block.path]
        _planted_kill(files)
        hit = [f for f in files if fail_on and fail_on in f]
        if hit:
            trace.set(hit[0])
            raise RuntimeError(f"planted failure ({FAIL_HOOK_ENV})")
        res = worker.process_block(block)
        for kind, at, reason in res.notes:
            if job.strict:  # the driver raises the first one in input order
                out.update(error=f"{at}: {reason}", kind="note")
                return
            note_counts[kind] = note_counts.get(kind, 0) + 1
            if sum(n[0] == kind for n in notes) < job.max_reported:
                notes.append((kind, at, reason))
        for key, n in res.counts.items():
            counts[key] += n
        if any(sp is not None for sp in res.spans):  # no loss-mask spill yet
            out.update(
                error=f"{res.sources[0]}: conversation and prompt-completion rows (a loss mask) "
                "are not supported by --engine ray yet; use --engine local",
                kind="note",
            )
            return
        for src, toks in zip(res.sources, res.tokens):
            spill.write(np.ascontiguousarray(toks, dtype=job.dtype).tobytes())
            out["lengths"].append(len(toks))
            out["names"].append(src)
        out["nbytes"] += res.nbytes
    out.update(notes=json.dumps(notes), note_counts=json.dumps(note_counts))
    out.update(counts=json.dumps(counts))


def tokenize_task(job: Job, row: dict) -> dict:
    """Stage 1: tokenize one group of files and spill the result. Failures come back as data:
    `error` names the input, `kind` is "note" (a bad, special or lossy input under --strict)
    or "task"."""
    idx, paths = int(row["idx"]), [str(p) for p in row["paths"]]
    out: dict = {"idx": idx, "error": "", "kind": "", "samples": 0, "nbytes": 0}
    out.update(notes="[]", note_counts="{}", counts="{}", lengths=[], names=[])
    base = _spill_base(job.root, idx)
    trace = None
    try:
        trace = _Trace(base, "tokenize", paths[0])
        if worker._WORKER.get("settings") != job.settings:
            worker.init_worker(job.settings)
        with open(base + ".bin.tmp", "wb") as spill:
            _tokenize_group(job, paths, spill, out, trace)
        if not out["error"]:
            os.replace(base + ".bin.tmp", base + ".bin")
            np.save(base + ".len.npy", np.asarray(out["lengths"], np.int64))
            with open(base + ".src.json", "w") as f:
                json.dump(out["names"], f)
            out["samples"] = len(out["lengths"])
    except Exception as exc:  # named by input file; the driver turns it into the run's error
        at = trace.at if trace is not None else paths[0]
        out.update(error=f"{at}: {type(exc).__name__}: {exc}", kind="task")
    del out["lengths"], out["names"]
    return out


def _planted_kill(files: list[str] | None = None, point: str = "") -> None:
    """Test-only (KILL_HOOK_ENV): this worker process dies: in a write task at `point` once per
    arming (ARM holds the point), in a tokenize task (`files`) whenever one of them has ALWAYS's
    name."""
    folder = os.environ.get(KILL_HOOK_ENV)
    if not folder:
        return
    if files is None:
        arm = os.path.join(folder, "ARM")
        with contextlib.suppress(FileNotFoundError):
            with open(arm) as f:
                armed = f.read().strip() == point
            if armed:
                os.rename(arm, os.path.join(folder, "FIRED"))  # one worker wins
                os._exit(1)
        return
    with contextlib.suppress(FileNotFoundError):
        with open(os.path.join(folder, "ALWAYS")) as f:
            name = f.read().strip()
        if name and any(os.path.basename(p) == name for p in files):
            os._exit(1)


def group_name(paths: list[str]) -> str:
    """A task's inputs in a message: its first file and how many follow."""
    more = len(paths) - 1
    return paths[0] + (f" (or one of the {more} files after it)" if more else "")


def write_task(job: Job, row: dict) -> dict:
    """Stage 2: write one group's shards into part-NNNNN/ with global sample ids from
    row["first_id"], plus its index part (index.parquet, shards.json)."""
    from datapipe.index import write_index

    idx, first_id = int(row["idx"]), int(row["first_id"])
    writer = None
    try:
        part = os.path.join(job.root, part_dir(idx))
        done = os.path.join(part, "shards.json")  # written last, by rename
        if os.path.exists(done):  # an earlier attempt finished; its worker died after
            return {"idx": idx, "error": ""}
        base = _spill_base(job.root, idx)
        _Trace(base, "write", row["inputs"])
        # Ray runs a task again when its worker dies: start from no files, not a dead attempt's
        shutil.rmtree(part, ignore_errors=True)
        os.makedirs(part)
        lengths = np.load(base + ".len.npy", allow_pickle=False)
        with open(base + ".src.json") as f:
            names = json.load(f)
        tokens = np.fromfile(base + ".bin", dtype=job.dtype)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        writer = build_writer(
            job.format, part, np.dtype(job.dtype), job.chunk_tokens, job.shard_bytes
        )
        for i in range(len(lengths)):
            writer.write(first_id + i, tokens[offsets[i] : offsets[i + 1]])
        shards = writer.finish()
        _planted_kill(point="shards")
        num_rows = np.maximum(1, -(-lengths // job.chunk_tokens))
        write_index(
            os.path.join(part, INDEX_FILE),
            lengths,
            np.asarray(writer.sample_shard, np.int32),
            np.asarray(writer.sample_first_row, np.int64),
            num_rows,
            names,
        )
        with open(done + ".tmp", "w") as f:
            json.dump([s.to_dict() for s in shards], f)
        os.replace(done + ".tmp", done)  # the part is complete; its spill goes
        for suffix in (".bin", ".len.npy", ".src.json"):
            os.remove(base + suffix)
        _planted_kill(point="done")
    except Exception as exc:
        if writer is not None:
            writer.abort()  # release open files; the driver's failure removes the directory
        return {"idx": idx, "error": f"{type(exc).__name__}: {exc}"}
    return {"idx": idx, "error": ""}


# --- runtime ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def ray_runtime(workers: int, address: str | None = None) -> Iterator[None]:
    """A Ray runtime for the run: reuse one this process already has; else join `address`, or
    start a local one with `workers` CPUs that listens on loopback only (shut down at the end)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # local node on 127.0.0.1
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private runtime, loopback only
    try:
        import ray
        import ray.data
    except ImportError as exc:
        raise MixlenError("--engine ray needs Ray Data: pip install 'mixlen[ray]'") from exc
    if ray.is_initialized():
        _quiet_ray_data()
        yield
        return
    kwargs: dict = dict(
        include_dashboard=False,
        configure_logging=True,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    if address is None:
        ray.init(address="local", num_cpus=workers, **kwargs)
    else:
        import datapipe

        _check_reachable(address)
        try:  # workers run this driver's mixlen, not whatever the cluster has installed
            ray.init(
                address=address,
                runtime_env={"py_modules": [os.path.dirname(datapipe.__file__)]},
                **kwargs,
            )
        except ConnectionError as exc:
            raise MixlenError(
                f"--ray-address {address}: cannot join the Ray cluster ({exc})"
            ) from None
    try:
        _quiet_ray_data()
        yield
    finally:
        ray.shutdown()


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """MixlenError naming --ray-address when HOST:PORT (or ray://HOST:PORT) does not accept a
    connection: ray.init would retry for minutes."""
    import socket

    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return  # "auto" and other forms: Ray resolves them itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise MixlenError(
            f"--ray-address {address}: cannot connect ({exc.strerror or exc}); is the cluster's "
            "head node running there (`ray start --head` prints its address)?"
        ) from None


def _quiet_ray_data() -> None:
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False  # mixlen draws its own
    logging.getLogger("ray.data").setLevel(logging.ERROR)


def _run_tasks(
    fn: Callable[[dict], dict], items: list[dict], bar, root: str, stage: str
) -> list[dict]:
    """One Ray Data task per item; results sorted by "idx" (tasks finish in any order). A task
    whose worker died on every try fails the run naming its input (`_Trace` in `root`)."""
    import ray.data
    import ray.exceptions

    # Ray Data runs a task again for ever when its worker dies; an input that kills every worker
    # that reads it (the kernel's OOM killer) would hang the run: a few tries, then the error
    ds = ray.data.from_items(items, override_num_blocks=len(items)).map(
        fn, max_retries=TASK_TRIES - 1
    )
    out = []
    try:
        for row in ds.iter_rows():
            out.append(dict(row))
            bar.update(bar_step(items, row))
    except ray.exceptions.RayError as exc:  # a worker died, a node left: not an input's fault
        lines = [x for x in str(exc).strip().splitlines() if x.strip()]
        why = f"{type(exc).__name__}: {lines[-1] if lines else exc}"
        dead = _dead_task(root, len(items), stage)
        if dead:
            raise MixlenError(
                f"--engine ray: {dead}: the worker process of its {stage} task died on each of "
                f"{TASK_TRIES} tries (killed by the system: out of memory?). Ray: {why}"
            ) from None
        raise MixlenError(f"--engine ray: Ray failed ({why})") from None
    return sorted(out, key=lambda r: r["idx"])


def _dead_task(root: str, tasks: int, stage: str) -> str:
    """The input a `stage` task was reading when its worker died for the last of TASK_TRIES
    tries ("" if no task was tried that often)."""
    for idx in range(tasks):
        path = f"{_spill_base(root, idx)}.{stage}"
        with contextlib.suppress(OSError):
            if os.path.getsize(path + ".tries") >= TASK_TRIES:
                with open(path + ".at") as f:
                    return f.read()
    return ""


def bar_step(items: list[dict], row: dict) -> int:
    """Bar advance of a finished task: its input bytes (stage 1) or one part (stage 2)."""
    return int(items[int(row["idx"])].get("bytes", 1))


# --- driver ----------------------------------------------------------------------------------------


def write_dataset(run: EngineRun) -> EngineResult:
    """Tokenize `run.files` in Ray Data tasks and write shards, index.parquet and manifest.json
    into `run.root` (the local engine's dataset; only shard boundaries differ)."""
    cfg, files, tokenizer, root, tally = run.cfg, run.files, run.tokenizer, run.root, run.tally
    job = Job(
        run.settings,
        root,
        cfg.format,
        tokenizer.dtype.name,
        cfg.chunk_tokens,
        cfg.shard_bytes,
        cfg.strict,
        cfg.max_reported,
    )
    os.makedirs(os.path.join(root, SPILL_DIR), exist_ok=True)
    groups = task_groups(files)
    sizes = input_sizes(files)
    items = [
        {"idx": i, "paths": g, "bytes": sum(sizes[p] for p in g)} for i, g in enumerate(groups)
    ]
    with ray_runtime(cfg.workers, cfg.ray_address):
        # stage 1: tokenize and spill
        with progress(
            sum(sizes.values()), "tokenize (ray)", "B", cfg.progress, unit_scale=True
        ) as bar:
            tok = _run_tasks(partial(tokenize_task, job), items, bar, root, "tokenize")
        for r in tok:  # in input order, as the local engine notes them
            if r["kind"] == "note":
                raise InputError(r["error"])
            if r["kind"] == "task":
                raise MixlenError(f"--engine ray: a tokenize task failed on {r['error']}")
            kept = json.loads(r["notes"])
            for kind, where, reason in kept:
                tally.note(kind, where, reason)
            for kind, n in json.loads(r["note_counts"]).items():
                tally.counts[NOTE_COUNTS[kind]] += n - sum(k[0] == kind for k in kept)
            for key, n in json.loads(r["counts"]).items():
                tally.counts[key] += n
        if not sum(r["samples"] for r in tok):
            raise tally.no_samples()
        first = np.concatenate([[0], np.cumsum([r["samples"] for r in tok])]).astype(np.int64)
        # stage 2: write the parts with global sample ids
        parts = [
            {"idx": r["idx"], "first_id": int(first[k]), "inputs": group_name(groups[r["idx"]])}
            for k, r in enumerate(tok)
        ]
        with progress(len(parts), "write (ray)", "part", cfg.progress) as bar:
            wrote = _run_tasks(partial(write_task, job), parts, bar, root, "write")
    for r in wrote:
        if r["error"]:
            paths = group_name(groups[r["idx"]])
            raise MixlenError(f"--engine ray: the write task for {paths} failed: {r['error']}")
    written = merge_parts(cfg.format, root, len(groups))
    written.engine = {"name": "ray", "address": cfg.ray_address, "tasks": len(groups)}
    shutil.rmtree(os.path.join(root, SPILL_DIR), ignore_errors=True)
    nbytes = sum(r["nbytes"] for r in tok)
    return EngineResult(write_metadata(run, written), nbytes)
