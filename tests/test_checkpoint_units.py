"""Checkpoint pieces in one process, without a training run: the directory lock released only by
its holder, JSON files complete before they get their name, the metadata reader's allow-list,
and each rank's own generators restored. The references are the file system, torch's own
generator and plain values written here."""

from __future__ import annotations

import json
import os
import pickle
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

import trainer.checkpoint.files as files_mod
from trainer.checkpoint.checkpointer import load_checkpoint
from trainer.checkpoint.files import SafeReader, write_json
from trainer.checkpoint.lock import LOCK_FILE, DirLock
from trainer.checkpoint.rng import capture_rng
from trainer.checkpoint.save import quiet_dcp


def test_release_leaves_a_lock_another_process_took(tmp_path) -> None:
    """A holder whose lock was taken over meanwhile (a restarted job on another host) must not
    delete the new holder's lock when it ends."""
    lock = DirLock(str(tmp_path))
    lock.acquire()
    path = tmp_path / LOCK_FILE
    theirs = {"job": "run-9", "host": "elsewhere", "pid": os.getpid() + 1, "started": 1}
    path.write_text(json.dumps(theirs))
    lock.release()
    assert path.exists() and json.loads(path.read_text()) == theirs
    # its own lock it does remove
    path.unlink()
    lock.acquire()
    assert path.exists()
    lock.release()
    assert not path.exists()


def test_write_json_is_whole_before_it_has_its_name(tmp_path, monkeypatch) -> None:
    """The file under its final name appears only after its bytes were flushed to disk: a crash
    before the fsync leaves the previous file (or none), never a half-written one."""
    target = tmp_path / "run.json"
    seen = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        seen.append(target.exists())
        real_fsync(fd)

    monkeypatch.setattr(files_mod.os, "fsync", fsync)
    write_json(str(target), {"step": 3})
    assert seen and seen[0] is False  # the content's fsync ran before the rename
    assert json.loads(target.read_text()) == {"step": 3}
    assert os.listdir(tmp_path) == ["run.json"]


class _Exec:
    """Pickles as a call of builtins.exec (a module the allow-list names for other classes)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


@pytest.mark.parametrize("payload", ["exec", "eval-getattr"])
def test_metadata_reader_refuses_builtins_outside_the_allow_list(tmp_path, payload) -> None:
    """`.metadata` calling builtins.exec (or reaching builtins.getattr) is refused before it
    runs, although builtins.set and builtins.frozenset are allowed."""
    marker = tmp_path / "pwned"
    d = tmp_path / "ckpt"
    d.mkdir()
    if payload == "exec":
        data = pickle.dumps(_Exec(str(marker)))
    else:  # protocol 0 GLOBAL of builtins.getattr, called on a string
        data = b"cbuiltins\ngetattr\n(S'x'\nS'upper'\ntR."
    (d / ".metadata").write_bytes(data)
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle builtins"):
        SafeReader(str(d)).read_metadata()
    assert not marker.exists()


class _Tiny:
    """The smallest StateOwner: one tensor."""

    def __init__(self) -> None:
        self.t = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.t = sd["t"]


def test_each_rank_restores_its_own_generators(tmp_path) -> None:
    """Rank 1 of a two-rank checkpoint draws what rank 1 would have drawn (its own rng file),
    not rank 0's; a rank the saved run did not have takes rank 0's."""
    d = tmp_path / "step-00000001"
    with quiet_dcp():
        dcp.save({"t": torch.arange(3.0)}, checkpoint_id=str(d))
    (d / "run.json").write_text(json.dumps({"step": 1, "world": 2}))
    want = {}
    for rank, seed in ((0, 11), (1, 22)):
        torch.manual_seed(seed)
        (d / f"rng-{rank:05d}.json").write_text(json.dumps(capture_rng()))
        want[rank] = torch.rand(4)  # what that rank draws next
    for rank, expect in ((1, want[1]), (0, want[0]), (2, want[0])):
        torch.manual_seed(999)
        state = _Tiny()
        comm = SimpleNamespace(rank=rank, size=3, group=None)
        run = load_checkpoint(str(d), state, None, comm, torch.device("cpu"))
        assert run["step"] == 1 and torch.equal(state.t, torch.arange(3.0))
        assert torch.equal(torch.rand(4), expect), rank


@pytest.mark.parametrize(
    "edit",
    [
        {"format": 1},  # another layout's table
        {"format": None},
        {"files": {"..": {"bytes": 1, "xxh3_64": "00"}}},  # a name outside the step
        {"files": {"a/b": {"bytes": 1, "xxh3_64": "00"}}},
        {"files": {"run.json": {"bytes": "1", "xxh3_64": "00"}}},
    ],
)
def test_a_checksums_table_of_another_format_or_naming_outside_files_is_refused(
    tmp_path, edit
) -> None:
    """checksums.json (written here by hand, as write_checksums lays it out) is read only when
    it has this format and names files of the step itself."""
    from trainer.checkpoint.files import CHECKPOINT_FORMAT, CHECKSUMS_FILE, read_checksums

    good = {"format": CHECKPOINT_FORMAT, "files": {"run.json": {"bytes": 2, "xxh3_64": "ab"}}}
    (tmp_path / CHECKSUMS_FILE).write_text(json.dumps(good))
    assert read_checksums(str(tmp_path)) == good["files"]
    (tmp_path / CHECKSUMS_FILE).write_text(json.dumps({**good, **edit}))
    with pytest.raises(ValueError, match=r"checksums.json (is malformed|lists)"):
        read_checksums(str(tmp_path))


def test_a_failed_save_calls_intact_only_a_checkpoint_still_on_disk(tmp_path) -> None:
    """The failure message names the newest of this run's own checkpoints that is still there
    (one removed by hand meanwhile is not intact), and says so when none is left."""
    from datapipe.errors import MixlenError
    from trainer.checkpoint.save import _SaveFailure
    from trainer.parallel.comm import SoloComm

    root = tmp_path / "ckpt"
    for k in (2, 3):  # step 3 is another run's (a resumed, abandoned one): not this run's
        (root / f"step-{k:08d}").mkdir(parents=True)
    cases = [([2, 4], "step-00000002 of this run is intact"),  # 4: removed by hand
             ([4], "this run has no earlier checkpoint")]  # fmt: skip
    for ours, kept in cases:
        failure = _SaveFailure(SoloComm(), torch.device("cpu"), str(root), 6, ours)
        with pytest.raises(MixlenError) as info:
            failure.check(OSError(5, "Input/output error"), shared=False)
        msg = str(info.value)
        assert "saving the checkpoint of step 6 failed" in msg and kept in msg, msg
        assert "Fix the cause" in msg and "step-00000004" not in msg, msg
    _SaveFailure(SoloComm(), torch.device("cpu"), str(root), 6, [2]).check(None, shared=False)
