"""Training metrics: `metrics.jsonl` (one JSON object per step), optional TensorBoard events, a
compact console line per step and a progress bar. Only the island's rank 0 writes.

Imbalance is max / mean over the ranks of the step (1.0 = perfect): `imbalance_measured` from the
ranks' measured compute spans (first micro-batch start to last micro-batch end, ring waits
included), `imbalance_planned` from the plan's slot-order replay of estimated times.

With several islands a record covers the whole run (`world_figures`, one all-reduce over the
run's processes per step): `tokens`, `samples`, `labelled`, `tokens_by_source` and the run's
mixture table are summed over the islands, `loss` is over every island's labelled positions
(co2 and diloco also record each island's as `loss_by_island`), `step_time_s` and `data_wait_s`
are the slowest island's and `tokens_per_s` is the run's tokens over that step time. Island 0's
alone (its plan, its ranks, its gradient): the per-rank lists, both imbalances,
`planned_makespan_s`, `policy`, `grad_norm` (co2 and diloco; sync's is the run's), `epoch`, the
validation figures, and global rank 0's own `comm_time_s`, `allreduce_bytes`,
`grad_comm_wait_s`, `grad_comm_hidden`, `cross_wait_s`; the balance report's rank table is island
0's ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from datapipe.errors import ConfigError
from datapipe.files import take_flock, write_text_atomic
from datapipe.settings import setting
from trainer.logs import get_logger

__all__ = [
    "BalanceSummary",
    "MetricsConfig",
    "MetricsWriter",
    "imbalance",
    "step_record",
    "world_figures",
]


@dataclass
class MetricsConfig:
    """`[metrics]`: metrics.jsonl (+ TensorBoard events if enabled and installed) in `dir`."""

    dir: str = setting(
        "runs/mixlen", help="metrics.jsonl, balance.md and config.toml go here", free_on_resume=True
    )
    tensorboard: bool = setting(
        False, help="also write TensorBoard events (needs tensorboard)", free_on_resume=True
    )
    progress: bool = setting(True, help="a progress bar on a terminal", free_on_resume=True)
    console_interval: int = setting(
        1, help="a console line every this many steps", lo=1, free_on_resume=True
    )
    compare: str = setting(
        "",
        help="another policy run on every compare_interval-th step's batch too (no update) and "
        'reported beside the run\'s policy ("": off)',
        choices=("", "static", "hdp", "naive-hdp"),
        free_on_resume=True,
    )
    compare_interval: int = setting(
        4, help="compare every this many steps", lo=1, free_on_resume=True
    )
    compare_clock: str = setting(
        "wall",
        help="the comparison's headline clock: wall (ranks on their own cores or GPUs) or cpu "
        "(each micro-batch's thread CPU time replayed in slot order: more ranks than cores, with a "
        "cost file from `mixlen calibrate --clock cpu`); both are recorded",
        choices=("wall", "cpu"),
        free_on_resume=True,
    )


def step_record(
    step: int,
    batch: Any,
    plan: Any,
    res: Any,
    lr: float,
    data_wait_s: float,
    step_s: float,
) -> dict[str, Any]:
    """The metrics.jsonl record of one step, from its global batch (datapipe.stream.GlobalBatch),
    StepPlan and the executor's StepResult."""
    planned = (plan.rank_time_ns / 1e9).tolist()
    return {
        "step": step,
        "loss": res.loss,
        "tokens": res.tokens,
        "samples": int(batch.sample_ids.shape[0]),
        "labelled": res.n_labels,  # the trained positions, with a loss mask
        "loss_divisor": res.loss_divisor,  # [train] loss_normalization's denominator
        "lr": lr,
        "grad_norm": res.grad_norm,
        "step_time_s": step_s,
        "tokens_per_s": res.tokens / step_s if step_s > 0 else 0.0,
        "data_wait_s": data_wait_s,
        "compute_time_s_per_rank": res.compute_s,
        "planned_time_s_per_rank": planned,
        "comm_time_s": res.rank_comm_s,
        "ring_wait_s_per_rank": res.ring_wait_s,
        "ring_bytes_per_rank": res.p2p_bytes,
        "allreduce_bytes": res.reduce_bytes,
        "grad_comm_wait_s": res.grad_wait_s,
        "grad_comm_hidden": res.grad_hidden,
        "cross_wait_s": res.cross_wait_s,
        "microbatches_per_rank": res.microbatches,
        "imbalance_measured": imbalance(res.compute_s),
        "imbalance_planned": imbalance(planned),
        "planned_makespan_s": plan.makespan_ns / 1e9,
        "policy": plan.policy,
        "epoch": batch.epoch,
    }


def world_figures(
    rec: dict[str, Any],
    above: dict[str, dict[int, int]] | None,
    rt: Any,
    summed: bool,
) -> dict[str, dict[int, int]] | None:
    """Make island figures of the step record `rec` the whole run's, in place (see the module
    docstring), and return `above` (a mixture's boosted tokens, datapipe's tokens_above) summed
    over the islands. Collective over `rt.run_comm` (every process of the run calls it; each
    island's rank 0, TP index 0, brings its island's figures). `summed`: sync mode, whose loss
    and labelled positions the executor already summed across islands."""
    import torch

    by_source = rec.get("tokens_by_source", {})
    boosted = [(name, t) for name, by in (above or {}).items() for t in by]
    head = ["tokens", "samples", "labelled", "loss", "step_time_s", "data_wait_s", "loss_divisor"]
    rows = torch.zeros(rt.islands, len(head) + len(by_source) + len(boosted), dtype=torch.float64)
    if rt.rank == 0 and getattr(rt, "tp_rank", 0) == 0:
        # the loss's own denominator (trained positions, or samples under "sequence")
        divisor = rec.get("loss_divisor") or rec["labelled"]
        mine = [rec[k] for k in head[:-1]] + [divisor]
        mine[3] *= divisor  # the island's loss sum
        mine += list(by_source.values()) + [above[name][t] for name, t in boosted]  # type: ignore[index]
        rows[rt.island] = torch.tensor(mine, dtype=torch.float64)
    rows = rows.to(rt.device)  # NCCL reduces CUDA tensors
    rt.run_comm.all_reduce(rows)
    rows = rows.cpu()
    total = rows.sum(0).tolist()
    for i, key in enumerate(("tokens", "samples")):
        rec[key] = int(round(total[i]))
    if not summed:
        rec["labelled"] = int(round(total[2]))
        rec["loss_by_island"] = (rows[:, 3] / rows[:, 6].clamp(min=1)).tolist()
        rec["loss"] = total[3] / max(total[6], 1)
        if "loss_divisor" in rec:
            rec["loss_divisor"] = int(round(total[6]))
    rec["step_time_s"] = float(rows[:, 4].max())
    rec["data_wait_s"] = float(rows[:, 5].max())
    step_s = rec["step_time_s"]
    rec["tokens_per_s"] = rec["tokens"] / step_s if step_s > 0 else 0.0
    n = len(head)
    if by_source:
        rec["tokens_by_source"] = {k: int(round(total[n + i])) for i, k in enumerate(by_source)}
    out: dict[str, dict[int, int]] | None = None if above is None else {k: {} for k in above}
    for i, (name, t) in enumerate(boosted):
        out[name][t] = int(round(total[n + len(by_source) + i]))  # type: ignore[index]
    return out


def imbalance(times: Any) -> float:
    """max / mean of per-rank times (1.0 when all equal or all zero)."""
    t = np.asarray(times, dtype=np.float64)
    mean = float(t.mean()) if t.size else 0.0
    return float(t.max() / mean) if mean > 0 else 1.0


@dataclass
class BalanceSummary:
    """Per-rank totals over the run, for the balance report written at the end."""

    measured_s: np.ndarray | None = None
    planned_s: np.ndarray | None = None
    microbatches: np.ndarray | None = None
    steps: int = 0
    step_time_s: float = 0.0
    tokens: int = 0
    offload: Any = None  # trainer.offload.plan.OffloadSummary when offload/checkpointing is on
    mix_tokens: dict[str, int] | None = None  # a mixture's tokens by source
    mix_target: dict[str, float] | None = None  # and the tokens its shares in force asked for

    mix_above: dict[str, dict[int, int]] | None = None  # boosted sources: tokens >= threshold
    islands: int = 1  # several: the rank table is island 0's ranks, the rest the whole run's
    start_step: int = 0  # a resumed run's first step was start_step + 1 (the report covers its own)

    def add_mix(
        self,
        tokens: dict[str, int],
        shares: dict[str, float],
        above: dict[str, dict[int, int]] | None = None,
    ) -> None:
        """A mixture step's tokens by source, the shares in force for it, and each boosted
        source's tokens from samples at or above its thresholds."""
        total = sum(tokens.values())
        if self.mix_tokens is None:
            self.mix_tokens = dict.fromkeys(tokens, 0)
            self.mix_target = dict.fromkeys(tokens, 0.0)
            self.mix_above = {}
        assert self.mix_target is not None and self.mix_above is not None
        for name, n in tokens.items():
            self.mix_tokens[name] += n
            self.mix_target[name] += shares.get(name, 0.0) * total
        for name, by in (above or {}).items():
            mine = self.mix_above.setdefault(name, dict.fromkeys(by, 0))
            for t, n in by.items():
                mine[t] += n

    def add(
        self,
        measured: list[float],
        planned: list[float],
        mbs: list[int],
        step_s: float,
        tokens: int,
    ) -> None:
        m, p, c = (np.asarray(x, dtype=np.float64) for x in (measured, planned, mbs))
        if self.measured_s is None:
            self.measured_s, self.planned_s, self.microbatches = m, p, c
        else:
            self.measured_s = self.measured_s + m
            self.planned_s = self.planned_s + p
            self.microbatches = self.microbatches + c
        self.steps += 1
        self.step_time_s += step_s
        self.tokens += tokens

    def render(self, policy: str) -> str:
        if self.measured_s is None:
            return "no steps\n"
        resumed = (
            f" (steps {self.start_step + 1}-{self.start_step + self.steps}: this run resumed "
            f"after step {self.start_step}; metrics.jsonl holds every step)"
            if self.start_step
            else ""
        )
        lines = [
            f"balance report: policy {policy}, {self.steps} steps{resumed}, {self.tokens} tokens, "
            f"{self.step_time_s:.2f} s of steps"
            + (
                f" ({self.islands} islands; the ranks below are island 0's)"
                if self.islands > 1
                else ""
            ),
            "",
            "| rank | micro-batches | measured compute s | planned s | measured share | planned share |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        ms, ps = self.measured_s.sum(), self.planned_s.sum()
        for r in range(self.measured_s.shape[0]):
            lines.append(
                f"| {r} | {int(self.microbatches[r])} | {self.measured_s[r]:.3f} | "
                f"{self.planned_s[r]:.3f} | {self.measured_s[r] / ms if ms else 0:.3f} | "
                f"{self.planned_s[r] / ps if ps else 0:.3f} |"
            )
        lines += [
            "",
            f"imbalance (max/mean of run totals): measured {imbalance(self.measured_s):.3f}, "
            f"planned {imbalance(self.planned_s):.3f}",
        ]
        lines += self.render_mix()
        extra = self.offload.render() if self.offload is not None else ""
        return "\n".join(lines) + "\n" + extra

    def render_mix(self) -> list[str]:
        """The mixture's realised token shares against its targets (the weights in force at
        each step, token-weighted over the run)."""
        if not self.mix_tokens or self.mix_target is None:
            return []
        total = sum(self.mix_tokens.values()) or 1
        lines = [
            "",
            "| source | tokens | realised share | target share | of its tokens, in samples >= |",
            "| --- | ---: | ---: | ---: | --- |",
        ]
        for name, n in self.mix_tokens.items():
            above = (self.mix_above or {}).get(name, {})
            tail = ", ".join(f"{t:,}: {k / n if n else 0:.3f}" for t, k in above.items()) or "-"
            lines.append(
                f"| {name} | {n:,} | {n / total:.4f} | {self.mix_target[name] / total:.4f} | {tail} |"
            )
        return lines


def _records(path: str) -> list[tuple[str, dict]]:
    """A metrics.jsonl's lines and records (a line cut short by a kill is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.append((line if line.endswith("\n") else line + "\n", rec))
    return out


def _claim(path: str, run_id: str, resume_step: int | None, say: Any) -> None:
    """Make `path` this run's metrics.jsonl (read once). Another run's records (any, for a fresh
    run) are renamed `metrics-RUN.jsonl` (`metrics-earlier.jsonl` when they name no one run),
    never written over; a resumed run's own file, moved aside so by a run since, is put back,
    and its records after `resume_step` (left by the interrupted run) are dropped."""
    folder = os.path.dirname(path)
    present = os.path.exists(path) and os.path.getsize(path) > 0
    records = _records(path) if present else []
    runs = {str(rec.get("run", "")) for _, rec in records}
    resumed = resume_step is not None
    if present and not (resumed and runs <= {"", run_id}):
        # (records without "run": written before runs had one)
        others = sorted(runs - {"", run_id})
        aside = _free_name(folder, f"metrics-{others[0] if len(others) == 1 else 'earlier'}")
        os.rename(path, aside)
        say(f"{path} held another run's metrics: moved to {os.path.basename(aside)}")
        records = []
    mine = os.path.join(folder, f"metrics-{run_id}.jsonl")
    if resumed and run_id and not os.path.exists(path) and os.path.exists(mine):
        os.rename(mine, path)
        say(f"{path}: this run's metrics put back from {os.path.basename(mine)}")
        records = _records(path)
    if resumed and os.path.exists(path):  # rewritten via a temp file
        keep = [line for line, rec in records if int(rec.get("step", 0)) <= resume_step
                and rec.get("run", run_id) == run_id]  # fmt: skip
        write_text_atomic(path, "".join(keep))


def _lock_folder(folder: str) -> int:
    """An exclusive lock on `folder`/.metrics.lock, held until closed (the kernel drops it when a
    process dies); ConfigError naming the folder and the holder when another run has it."""
    import socket

    fd = os.open(os.path.join(folder, ".metrics.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        holder = take_flock(fd, f"pid {os.getpid()} on {socket.gethostname()}")
    except OSError:  # ENOLCK, ENOSYS, EOPNOTSUPP: a file system without locks, unguarded
        return fd
    if holder is not None:
        os.close(fd)
        raise ConfigError(
            f"metrics.dir {folder}: another run ({holder}) is writing its metrics there; give "
            "this run its own metrics.dir"
        )
    return fd


def _free_name(folder: str, stem: str) -> str:
    """`stem.jsonl` in `folder`, or `stem.N.jsonl` for the first N not taken."""
    name, n = os.path.join(folder, stem + ".jsonl"), 1
    while os.path.lexists(name):
        name, n = os.path.join(folder, f"{stem}.{n}.jsonl"), n + 1
    return name


@dataclass
class MetricsWriter:
    """Writes one record per step; inactive (no files, no output) on ranks other than 0."""

    out_dir: str
    total_steps: int
    active: bool = True
    tensorboard: bool = False
    progress: bool = True
    console_interval: int = 1
    stream: TextIO | None = None  # console lines: None logs them (trainer.logs), else printed here
    # None: a fresh run (metrics.jsonl starts empty); k: resumed after step k (records of later
    # steps, left by the interrupted run, are dropped so the file reads as one run)
    resume_step: int | None = None
    # the run's identity (trainer.checkpoint's run_id), in every record: another run's
    # metrics.jsonl in this directory is moved aside, never written over or continued
    run_id: str = ""

    def __post_init__(self) -> None:
        self._jsonl = None
        self._tb = None
        self._bar = None
        self._lock: int | None = None
        if not self.active:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        self._lock = _lock_folder(self.out_dir)  # one run at a time writes here
        self.path = os.path.join(self.out_dir, "metrics.jsonl")
        try:
            _claim(self.path, self.run_id, self.resume_step, get_logger().warning)
            self._jsonl = open(self.path, "w" if self.resume_step is None else "a", buffering=1)
        except BaseException:  # the lock is released: the caller never closes a failed writer
            os.close(self._lock)
            self._lock = None
            raise
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.echo(
                    "metrics.tensorboard = true, but the tensorboard package is not installed "
                    "(pip install tensorboard); writing metrics.jsonl only"
                )
            else:
                purge = None if self.resume_step is None else self.resume_step + 1
                tb = os.path.join(self.out_dir, "tb", self.run_id)  # a TensorBoard run per run
                self._tb = SummaryWriter(log_dir=tb, purge_step=purge)
        if self.progress:  # a bar on a terminal only (datapipe.progress)
            from datapipe.progress import progress

            self._bar = progress(self.total_steps, "train", "step")

    def echo(self, line: str) -> None:
        if not self.active:
            return
        if self.stream is None:
            get_logger("metrics").info(line)
        elif self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def set_start(self, step: int) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def log(self, record: dict[str, Any]) -> None:
        """Append a step record (needs `step`); scalars also go to TensorBoard."""
        if not self.active:
            return
        if self._jsonl is not None:
            line = json.dumps({**record, "run": self.run_id} if self.run_id else record) + "\n"
            try:
                self._jsonl.write(line)
            except OSError as exc:  # a full disk: the metrics stop, the run (and its saves) not
                self._give_up("_jsonl", self.path, exc)
        if self._tb is not None:
            try:
                for k, v in record.items():
                    if isinstance(v, (int, float)) and k != "step":
                        self._tb.add_scalar(k, v, record["step"])
            except OSError as exc:
                self._give_up("_tb", os.path.join(self.out_dir, "tb", self.run_id), exc)
        if "loss" in record:
            if self._bar is not None:
                self._bar.update(1)
                self._bar.set_postfix(loss=f"{record['loss']:.4f}")
            if record["step"] % self.console_interval == 0 or record["step"] == self.total_steps:
                self.echo(_console_line(record))
        elif "val_loss" in record:
            self.echo(
                f"step {record['step']:>5}  val_loss {record['val_loss']:.4f}  "
                f"({record['val_tokens']} tokens)"
            )

    def _give_up(self, attr: str, path: str, exc: OSError) -> None:
        """Stop writing one output after a write failed (logged once, as an error)."""
        get_logger().error(
            f"{path}: cannot write ({exc.strerror or exc}); no more metrics are recorded there "
            "this run, and training goes on (checkpoints are written elsewhere, or fail loudly)"
        )
        out = getattr(self, attr)
        setattr(self, attr, None)
        with contextlib.suppress(OSError):
            out.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        for attr in ("_jsonl", "_tb"):
            out = getattr(self, attr)
            if out is not None:
                try:
                    out.close()
                except OSError as exc:  # its last records could not be written
                    self._give_up(attr, os.path.join(self.out_dir, attr.strip("_")), exc)
                setattr(self, attr, None)
        if self._lock is not None:
            os.close(self._lock)  # released; the file stays (unlinking it would race a taker)
            self._lock = None


def _console_line(r: dict[str, Any]) -> str:
    return (
        f"step {r['step']:>5}  loss {r['loss']:.4f}  lr {r.get('lr', 0):.2e}  "
        f"tok {r['tokens']:>7} (trained {r.get('labelled', 0):>7})  "
        f"{r['tokens_per_s']:>8.0f} tok/s  step {r['step_time_s']:.2f}s  "
        f"wait {r['data_wait_s']:.2f}s  comm {r['comm_time_s']:.2f}s  "
        f"imb {r['imbalance_measured']:.2f}/{r['imbalance_planned']:.2f}"
        + (f"  val_loss {r['val_loss']:.4f}" if "val_loss" in r else "")
    )
