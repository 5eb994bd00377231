"""The loss's forward and backward: mixlen's chunked loss (trainer.model.loss) beside two
formulations written here, side by side in one run on the same inputs:

    whole        torch's F.cross_entropy on the whole [T, V] float32 logits, autograd
                 (TorchTitan's loss; holds the logits and their log-softmax)
    chunked, plain  the same chunks as mixlen's, each written plainly: torch.logsumexp, then the
                 softmax as a new tensor exp(logits - lse), then scaled (mixlen's loss before
                 it computed the exponentials once, in place)
    mixlen       trainer.model.loss.linear_cross_entropy
    mixlen, compiled  the same with each chunk's arithmetic compiled by inductor (`[train] compile`;
                 bfloat16 and float16 only, where the loss takes that path)
    mixlen REV   with --baseline REV: trainer/model/loss.py as it was at git revision REV (read
                 with `git show`, loaded beside today's), to measure a change to it in one run

For each: the median time of forward + backward over the repeats after one untimed call (this thread's CPU time: a
shared box disturbs it less than wall time), and the peak bytes of tensors it allocated on top of
its inputs (torch's CPU allocator is not tracked, so peak is counted by a dispatch mode: every
tensor an operator returns, freed when Python drops it).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_loss.py [--tokens 4096] [--vocab 32768,131072]
        [--baseline REV]

Prints a table and writes benchmarks/out/bench_loss.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from at_revision import module_at  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from datapipe.files import write_text_atomic  # noqa: E402
from trainer.model.loss import chunk_tokens, linear_cross_entropy  # noqa: E402


class PeakBytes(TorchDispatchMode):
    """Bytes of the tensors operators return while alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.seen:
                    n = st.nbytes()
                    self.seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, key, n)
        return out


def whole(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((h @ w.t()).float(), labels, reduction="sum")


class _PlainChunks(torch.autograd.Function):
    """Chunks as mixlen's, each one written plainly (logsumexp, a new softmax, a scale)."""

    @staticmethod
    def forward(ctx, h, w, labels, chunk):  # noqa: ANN001, ANN205
        loss = torch.zeros((), dtype=torch.float32)
        dh, dw = torch.empty_like(h), torch.zeros(w.shape, dtype=torch.float32)
        for s in range(0, h.shape[0], chunk):
            hc, lab = h[s : s + chunk], labels[s : s + chunk]
            logits = (hc @ w.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, lab[:, None])[:, 0]
            loss += (lse - target).sum()
            g = torch.exp(logits - lse[:, None])
            g.scatter_add_(1, lab[:, None], -torch.ones_like(lse)[:, None])
            g = g.to(h.dtype)
            dh[s : s + chunk] = g @ w
            dw.addmm_(g.t().float(), hc.float())
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        dh, dw = ctx.saved_tensors
        return dh * g, (dw * g).to(dh.dtype), None, None


def plain_chunks(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _PlainChunks.apply(h, w, labels, chunk_tokens(w.shape[0]))


def mixlen(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return linear_cross_entropy(h, w, labels)


def mixlen_compiled(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return linear_cross_entropy(h, w, labels, compile="inductor")


KINDS = {
    "whole": whole, "chunked, plain": plain_chunks, "mixlen": mixlen,
    "mixlen, compiled": mixlen_compiled,
}  # fmt: skip


def loss_at(rev: str):  # noqa: ANN201
    """`linear_cross_entropy` of trainer/model/loss.py at git revision `rev`."""
    module = module_at(rev, "trainer/model/loss.py")
    return lambda h, w, labels: module.linear_cross_entropy(h, w, labels)


def measure(fn, h, w, labels, repeats: int) -> tuple[float, int | None, float]:  # noqa: ANN001
    """(median CPU seconds of forward + backward, peak allocated bytes or None, loss)."""
    times = []
    fn(h, w, labels).backward()  # warm: a compiled kind compiles here
    for _ in range(repeats):
        h.grad = w.grad = None
        t0 = time.thread_time()
        loss = fn(h, w, labels)
        loss.backward()
        times.append(time.thread_time() - t0)
    h.grad = w.grad = None
    if fn is mixlen_compiled:  # torch.compile refuses to run under a dispatch mode: no peak
        loss = fn(h, w, labels)
        return statistics.median(times), None, float(loss.detach())
    with PeakBytes() as mode:
        loss = fn(h, w, labels)
        loss.backward()
    return statistics.median(times), mode.peak, float(loss.detach())


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", default="32768,131072")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", help="also the loss at this git revision (e.g. HEAD~1)")
    args = p.parse_args()
    torch.set_num_threads(1)
    kinds = dict(KINDS)
    if args.baseline:
        kinds[f"mixlen {args.baseline}"] = loss_at(args.baseline)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for vocab in (int(v) for v in args.vocab.split(",")):
            g = torch.Generator().manual_seed(0)
            h = torch.randn(args.tokens, args.dim, generator=g).to(dtype).requires_grad_()
            w = (torch.randn(vocab, args.dim, generator=g) * 0.05).to(dtype).requires_grad_()
            labels = torch.randint(0, vocab, (args.tokens,), generator=g)
            # `compile` takes the compiled path in a lower compute dtype only (trainer/model/loss.py)
            run = {k: fn for k, fn in kinds.items() if fn is not mixlen_compiled or dtype_name
                   in ("bfloat16", "float16")}  # fmt: skip
            res = {k: measure(fn, h, w, labels, args.repeats) for k, fn in run.items()}
            base = res["mixlen"][0]
            for k, (secs, peak, loss) in res.items():
                rows.append({
                    "dtype": dtype_name, "tokens": args.tokens, "vocab": vocab, "dim": args.dim,
                    "kind": k, "seconds": secs, "x_mixlen": secs / base,
                    "peak_mib": None if peak is None else peak / 2**20,
                    "loss": loss,
                })  # fmt: skip
    print("| dtype | T x V | loss | s (fwd+bwd) | x mixlen's time | peak MiB |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['tokens']} x {r['vocab']} | {r['kind']} | {r['seconds']:.3f} "
            f"| {r['x_mixlen']:.2f} | {_mib(r['peak_mib'])} |"
        )
    out = os.path.join(ROOT, "benchmarks", "out", "bench_loss.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    write_text_atomic(out, json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
