"""A mixture stream's resumable state: what a checkpoint saves of it, what a resume checks, and
how a resume restores it (datapipe.mix.stream.MixtureStream's `state_dict` / `load_state_dict`).

Saved: each source's epoch, cursor (and offset into a sample being cut), deferred units, token
count, whether it ran out, its dataset's fingerprint and samples' digest, its boosts; the stage
and segment in force; the unit counter and the step. A resume keeps the sources (same names,
order, datasets and `length_boost`); weights, stages and `max_epochs` may change and apply from
the resume step on (a source past a lowered `max_epochs` stops at the resume step). A run on one dataset (`data.path`) resumed with `data.stages` continues as a
one-source mixture from the dataset's next epoch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from datapipe.errors import ConfigError
from datapipe.mix.fill import ST_TOTAL

MixtureStream = Any  # datapipe.mix.stream.MixtureStream (which imports this module)

__all__ = ["STATE_VERSION", "check_state", "load_state", "state_of"]

STATE_VERSION = 2


def state_of(m: MixtureStream) -> dict[str, Any]:
    """The stream's position and what it depends on (plain ints, floats and strings)."""
    stage = m.stage or m.stage_at(m.step + 1)
    per = {}
    for s, src in enumerate(m.sources):
        nd = int(m.ndef[s])
        per[src.name] = {
            "epoch": int(m.epoch[s]),
            "cursor": int(m.cur_rel[s]),
            "cursor_offset": int(m.cur_off[s]),
            "deferred": [
                [int(m.dsid[s, i]), int(m.doff[s, i]), int(m.dlen[s, i])] for i in range(nd)
            ],
            "taken": int(m.taken[s]),
            "exhausted": bool(m.exhausted[s]),
            "num_samples": int(src.ids.shape[0]),
            "lengths_digest": src.digest,
            "fingerprint": src.fingerprint,
            "length_boost": [[t, f] for t, f in src.boosts],
        }
    segment = None
    if m.stage is not None:
        segment = {
            "stage_weights": [float(x) for x in stage.weights],
            "weights": [float(x) for x in m.weights],
            "max_sample_tokens": stage.max_sample_tokens,
            "global_batch_tokens": stage.global_batch_tokens,
            "total": int(m.st[ST_TOTAL]),
        }
    return {
        "version": STATE_VERSION,
        "kind": "mixture",
        "step": m.step,
        "units": m.units,
        "seed": int(m.config.seed),
        "lookahead": int(m.config.lookahead),
        "num_islands": m.num_islands,
        "island": m.island,
        "stage": stage.index,
        "stage_start_step": stage.start_step,
        "segment": segment,
        "order": list(m.source_names),
        "sources": per,
        "lengths_digest": m.lengths_digest(),
    }


def check_state(m: MixtureStream, state: dict[str, Any], allow_other_dataset: bool = False) -> None:
    """ConfigError, naming the key, if `state` was not saved by this mixture (another seed,
    look-ahead, island count, sources, datasets or boosts); a one-dataset run's state passes when
    this stream is that dataset as a one-source mixture."""
    k = m.names
    if state.get("kind") != "mixture":
        if not m.from_path:
            raise ConfigError(
                f"stream state: saved by a run on one dataset ({k('path')}), this run reads "
                f"{k('sources')}; a resume keeps the run's data (data.path with data.stages "
                "continues a data.path run)"
            )
        _check_key(m, state, "seed")
        return
    for key in ("version", "seed", "lookahead"):
        _check_key(m, state, key)
    islands = state.get("num_islands")
    if islands != m.num_islands:
        raise ConfigError(
            f"stream state: {k('num_islands')}={islands!r} was saved, but this run has "
            f"{m.num_islands}"
        )
    saved = state.get("sources", {})
    if list(state.get("order", [])) != list(m.source_names):
        raise ConfigError(
            f"{k('sources')}: the checkpoint's mixture has sources {state.get('order')} in this "
            f"order, this config {list(m.source_names)}; a resumed run keeps its sources and "
            "their order (weights and stages may change)"
        )
    for s, src in enumerate(m.sources):
        st, key = saved[src.name], m.source_key(s)
        if st["lengths_digest"] != src.digest or st["num_samples"] != src.ids.shape[0]:
            raise ConfigError(
                f"{key}: source {src.name!r} is not the dataset the checkpoint was saved on "
                "(its samples differ)"
            )
        if st.get("fingerprint") != src.fingerprint and not allow_other_dataset:
            raise ConfigError(
                f"{key}: source {src.name!r} is dataset {src.fingerprint}, the checkpoint was "
                f"saved on {st.get('fingerprint')} (the same lengths, other contents: `mixlen "
                "verify` prints a dataset's fingerprint); set data.allow_other_dataset = true for "
                "a re-sharded copy of it"
            )
        if [list(x) for x in st["length_boost"]] != [[t, f] for t, f in src.boosts]:
            raise ConfigError(
                f"{key}.length_boost: {st['length_boost']} was saved; a resumed run keeps it (it "
                "shapes the epoch in progress)"
            )


def _check_key(m: MixtureStream, state: dict[str, Any], key: str) -> None:
    mine = {
        "version": STATE_VERSION,
        "seed": int(m.config.seed),
        "lookahead": int(m.config.lookahead),
    }
    if state.get(key) != mine[key]:
        name = m.names(key)
        raise ConfigError(
            f"stream state: {name}={state.get(key)!r} was saved, but this stream has "
            f"{name}={mine[key]!r}" + ("" if key == "version" else " (set it to match)")
        )


def load_state(m: MixtureStream, state: dict[str, Any]) -> None:
    """Check `state` (`check_state`), then continue where it was saved."""
    check_state(m, state, allow_other_dataset=True)  # the checkpointer checked fingerprints
    if state.get("kind") != "mixture":  # a one-dataset run: its next epoch, as a mixture
        m.step, m.units = int(state["step"]), 0
        m.epoch[0] = int(state["epoch"]) + 1
        m.restart_order(0)
        m.log(
            f"data: resumed a run on one dataset under {m.names('stages')}: the stream starts "
            f"its epoch {int(m.epoch[0])} at step {m.step + 1}"
        )
        return
    for s, src in enumerate(m.sources):
        st = state["sources"][src.name]
        m.epoch[s] = int(st["epoch"])
        m.restart_order(s)
        m.cur_rel[s], m.cur_off[s] = int(st["cursor"]), int(st["cursor_offset"])
        d = np.asarray(st["deferred"], np.int64).reshape(-1, 3)
        m.set_deferred(s, d)
        m.taken[s] = int(st["taken"])
    m.step, m.units = int(state["step"]), int(state["units"])
    _apply_max_epochs(m, state)
    seg = state["segment"]
    stage = m.stage_at(m.step + 1)
    same = (
        seg is not None
        and _same_shares(stage.weights, [float(x) for x in seg["stage_weights"]])
        and (stage.max_sample_tokens, stage.global_batch_tokens)
        == (seg["max_sample_tokens"], seg["global_batch_tokens"])
    )
    if (
        same
        and state.get("stage") == stage.index
        and not (m.exhausted != _saved_out(m, state)).any()
    ):
        m.stage = stage
        m.weights = np.asarray(seg["weights"], np.float64)
        m.st[ST_TOTAL] = int(seg["total"])
    else:  # the stages (or a source's max_epochs) changed: a segment starts here
        m.stage = None


def _same_shares(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two normalised weight lists are the same mixture: equal up to the last bits
    that dividing by another sum leaves (weights scaled by one factor on a resume)."""
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-12) for x, y in zip(a, b))


def _apply_max_epochs(m: MixtureStream, state: dict[str, Any]) -> None:
    """Each source's `max_epochs` from the resume step on: a source that ran out draws again if
    it was raised; one that has already made as many passes as a lowered one allows (its epoch
    index reached it) is out from this step, the rest of its pass in progress and its deferred
    units left undrawn."""
    refillable = m.refillable_now()
    for s, src in enumerate(m.sources):
        ran_out = bool(state["sources"][src.name]["exhausted"])
        limit, epoch = src.max_epochs, int(m.epoch[s])
        past = bool(limit) and epoch >= limit
        m.exhausted[s] = (ran_out and not refillable[s]) or past
        if past and not ran_out:
            m.log(
                f"data: source {src.name!r} has made {epoch} pass{'es' if epoch > 1 else ''}, "
                f"at least its max_epochs ({limit}, lowered on resume): it stops at step "
                f"{m.step + 1}, in its pass {epoch + 1}; its share goes to the other sources"
            )


def _saved_out(m: MixtureStream, state: dict[str, Any]) -> np.ndarray:
    return np.array([bool(state["sources"][n]["exhausted"]) for n in m.source_names])
