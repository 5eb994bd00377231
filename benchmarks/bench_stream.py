"""Stream + fetch throughput on MDS (local disk), side by side with the streaming library's readers.

Dataset: N lognormal samples (median 512 tokens, sigma 1), bytes tokenizer (uint16), written once by
`mixlen preprocess` (datapipe.ingest) into benchmarks/out/data/mds-<N> and reused.

Rows of the table (same random sample order for every reader that can take one):
  stream          global batch formation (ids + lengths only), samples/s
  (a) iterate     `for x in StreamingDataset(local=...)`, sequential, shuffle off
  (b) ds[i]       `StreamingDataset.get_item(i)` in the stream's random order
  (c) memmap      np.memmap of the shard files, copy each sample's token bytes: the practical limit
  fetch/reader    datapipe.fetch (pread, token column decoded directly) -> packed micro-batches
  fetch/library   the same with the library's MDSReader.decode_sample per row (reader.direct off)
  fetch/dataset   datapipe.fetch with mds_access="dataset" (StreamingDataset indexing)
"cold" rows evict the shard files from the page cache first (posix_fadvise DONTNEED).

usage: .venv/bin/python benchmarks/bench_stream.py [--samples 100000] [--ranks 8] [--steps 20]
       .venv/bin/python benchmarks/bench_stream.py --mixture [--mix-samples 1000000]
       .venv/bin/python benchmarks/bench_stream.py --masks [--mask-samples 20000]

--masks: what a loss mask costs the fetch. The same conversations (three turns, lognormal
lengths, bytes tokenizer) written twice per format, as conversations with a mask (the demo's
chat template) and flattened into text rows without one; the fetch of the same whole-sample
steps (one rank of --ranks, warm page cache) timed on the masked dataset, on its rows read
without their mask (the cost of the mask alone) and on the flattened dataset, interleaved, best
of --repeats, in CPU seconds of the process; and the bytes per token the mask adds to the shards.

--mixture: batch formation of a mixture of three sources (1M samples in all: short, medium and
long lognormal lengths) by datapipe.mix's stream against one dataset holding the same samples
(datapipe.stream), same budget; weights are the sources' natural token shares, so both draw
every sample about once over the batches timed. Time (build + one epoch's batches) and peak
traced memory (tracemalloc: numpy's buffers) for each, best of --repeats, interleaved.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "out"


def make_dataset(n: int, seed: int = 0) -> Path:
    from datapipe.ingest.preprocess import PreprocessConfig, preprocess

    root = OUT / "data" / f"mds-{n}"
    if (root / "manifest.json").exists():
        return root
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(512), 1.0, n), 1, 60000).astype(np.int64)
    src = OUT / "data" / f"docs-{n}.jsonl"
    src.parent.mkdir(parents=True, exist_ok=True)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)
    with open(src, "w") as f:
        for k in lengths:
            text = letters[rng.integers(0, len(letters), int(k) - 2 if k > 2 else 1)].tobytes()
            f.write('{"text": "' + text.decode() + '"}\n')
    preprocess(PreprocessConfig(inputs=[str(src)], out=str(root), format="mds", progress=False))
    src.unlink()
    return root


def evict(root: Path) -> None:
    """Drop the dataset's files from the page cache (clean pages; no root needed)."""
    for p in root.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def rank_pieces(batch_ids: np.ndarray, lengths: np.ndarray, ranks: int, rank: int) -> np.ndarray:
    """Whole-sample pieces of one rank: every `ranks`-th sample of the global batch."""
    ids = batch_ids[rank::ranks]
    return np.stack([ids, np.zeros_like(ids), lengths[ids]], axis=1)


def bench_stream(root: Path, budget: int) -> dict:
    from datapipe.stream import StreamConfig

    t0 = time.perf_counter()
    s = StreamConfig(seed=0).open(str(root), budget)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    steps = s.steps_in_epoch(0)
    n = sum(len(next(s).sample_ids) for _ in range(steps))
    t_epoch = time.perf_counter() - t0
    # scale: 10M in-memory lengths, 32M-token global batches (ByteScale's size)
    big = np.maximum(1, np.random.default_rng(1).lognormal(np.log(2048), 1.5, 10_000_000)).astype(
        np.int64
    )
    bs = StreamConfig().build(big, 32 << 20)
    t0 = time.perf_counter()
    bs.steps_in_epoch(0)
    t_plan = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        next(bs)
    t_next = (time.perf_counter() - t0) / 100
    return {
        "build_s": t_build,
        "epoch_samples": n,
        "epoch_s": t_epoch,
        "samples_per_s": n / t_epoch,
        "big_samples": len(big),
        "big_epoch_plan_s": t_plan,
        "big_next_ms": t_next * 1e3,
    }


def bench_fill(repeats: int = 3) -> list[dict]:
    """Batch formation alone, greedy vs look-ahead fill, on in-memory lengths: epoch plan time and
    token fill (mean tokens per batch / budget, smallest batch)."""
    from datapipe.stream import StreamConfig

    rng = np.random.default_rng(1)
    cases = [
        ("100k lognormal (median 512, sigma 1), 1M-token batches", 100_000, 512, 1.0, 1 << 20, 0),
        (
            "100k lognormal capped 16K, 16K-token batches (the demo's shape)",
            100_000,
            2048,
            1.5,
            16384,
            16384,
        ),  # fmt: skip
        (
            "10M lognormal (median 2048, sigma 1.5), 32M-token batches",
            10_000_000,
            2048,
            1.5,
            32 << 20,
            0,
        ),
    ]
    rows = []
    for name, n, med, sigma, budget, cap in cases:
        lengths = np.maximum(1, rng.lognormal(np.log(med), sigma, n)).astype(np.int64)
        if cap:
            lengths = np.minimum(lengths, cap)
        for w in (0, 64):
            best = float("inf")
            for _ in range(repeats):
                s = StreamConfig(lookahead=w).build(lengths, budget)
                t0 = time.perf_counter()
                steps = s.steps_in_epoch(0)
                best = min(best, time.perf_counter() - t0)
            _, bounds = s._epoch_plan(0)
            order = s._plan[1]
            tok = np.add.reduceat(lengths[order], bounds[:-1])
            rows.append(
                {
                    "case": name,
                    "lookahead": w,
                    "epoch_plan_s": best,
                    "batches": steps,
                    "fill": float(tok.mean() / budget),
                    "min_batch_tokens": int(tok.min()),
                }
            )
    print(f"{'case':<66}{'W':>4}{'plan s':>9}{'batches':>9}{'fill':>8}{'min tokens':>12}")
    for r in rows:
        print(
            f"{r['case']:<66}{r['lookahead']:>4}{r['epoch_plan_s']:>9.3f}{r['batches']:>9,}"
            f"{r['fill']:>8.4f}{r['min_batch_tokens']:>12,}"
        )
    return rows


def mixture_lengths(total: int, seed: int = 2) -> list[np.ndarray]:
    """Three sources' lengths, `total` samples in all: 60% short (median 256), 30% medium
    (median 2,048), 10% long (median 16,384, capped at 262,144)."""
    rng = np.random.default_rng(seed)
    out = []
    for share, median in ((0.6, 256), (0.3, 2048), (0.1, 16384)):
        n = int(total * share)
        out.append(np.clip(rng.lognormal(np.log(median), 1.0, n), 1, 1 << 18).astype(np.int64))
    return out


def bench_mixture(total: int, budget: int, repeats: int) -> dict:
    """Mixture vs one dataset: seconds and peak traced bytes to build the stream and form one
    epoch's batches of the single dataset (the same number of batches for both)."""
    import tracemalloc

    from datapipe.mix.config import SourceConfig
    from datapipe.mix.stream import MixSource, MixtureStream
    from datapipe.stream import StreamConfig

    parts = mixture_lengths(total)
    allL = np.concatenate(parts)
    tokens = np.array([p.sum() for p in parts], np.float64)
    weights = tokens / tokens.sum()
    n_batches = StreamConfig().build(allL, budget).steps_in_epoch(0)

    fill: dict[str, float] = {}

    def run(name: str, s) -> int:
        tokens = n = 0
        for _ in range(n_batches):
            b = next(s)
            n += b.sample_ids.shape[0]
            tokens += int(b.lengths.sum())
        fill[name] = tokens / (n_batches * budget)
        return n

    def single() -> int:
        return run("one dataset", StreamConfig(seed=0).build(allL, budget))

    def mixture() -> int:
        srcs = [MixSource(f"s{i}", p, np.arange(p.shape[0])) for i, p in enumerate(parts)]
        cfgs = [SourceConfig(path=f"s{i}", weight=float(w)) for i, w in enumerate(weights)]
        return run("mixture of 3", MixtureStream(StreamConfig(seed=0), srcs, cfgs, [], budget))

    mixture()  # the kernel's compilation (cached on disk) outside the clock
    best: dict[str, dict] = {}
    for _ in range(repeats):
        for name, fn in (("one dataset", single), ("mixture of 3", mixture)):
            tracemalloc.start()
            t0 = time.perf_counter()
            n = fn()
            dt = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            if name not in best or dt < best[name]["seconds"]:
                best[name] = {"seconds": dt, "samples": n, "peak_bytes": peak}
    for name, r in best.items():
        r["fill"] = fill[name]
        r["batches_per_s"] = n_batches / r["seconds"]
        r["peak_bytes_per_sample"] = r["peak_bytes"] / total
    one, mix = best["one dataset"], best["mixture of 3"]
    print(f"{total:,} samples in 3 sources, {n_batches:,} batches of {budget:,} tokens")
    print(
        f"{'stream':<16}{'seconds':>9}{'batches/s':>11}{'samples':>11}{'fill':>8}{'peak MB':>9}"
        f"{'B/sample':>10}"
    )
    for name, r in best.items():
        print(
            f"{name:<16}{r['seconds']:>9.2f}{r['batches_per_s']:>11,.0f}{r['samples']:>11,}"
            f"{r['fill']:>8.4f}{r['peak_bytes'] / 1e6:>9.1f}{r['peak_bytes_per_sample']:>10.1f}"
        )
    ratio = mix["seconds"] / one["seconds"]
    print(
        f"mixture / one dataset: {ratio:.2f}x time, {mix['peak_bytes'] / one['peak_bytes']:.2f}x memory"
    )
    return {
        "samples": total,
        "budget": budget,
        "batches": n_batches,
        "rows": best,
        "time_ratio": ratio,
    }


MASK_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"


def make_mask_datasets(n: int, seed: int = 3) -> dict[str, tuple[Path, Path]]:
    """Per format: (masked, flat) datasets of the same `n` conversations (module docstring)."""
    from datapipe.ingest.chat import ChatTemplate, TemplateSource
    from datapipe.ingest.preprocess import PreprocessConfig, preprocess

    base = OUT / "data" / f"masks-{n}"
    out = {f: (base / f"{f}-masked", base / f"{f}-flat") for f in ("mds", "wds", "parquet")}
    if all((p / "manifest.json").exists() for pair in out.values() for p in pair):
        return out
    rng = np.random.default_rng(seed)
    template = ChatTemplate(TemplateSource(MASK_TEMPLATE, "bench"))
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)

    def text(k: int) -> str:
        return letters[rng.integers(0, len(letters), max(1, k))].tobytes().decode()

    base.mkdir(parents=True, exist_ok=True)
    tpl = base / "template.jinja"
    tpl.write_text(MASK_TEMPLATE)
    with open(base / "masked.jsonl", "w") as fm, open(base / "flat.jsonl", "w") as ff:
        for total in np.clip(rng.lognormal(np.log(1024), 1.0, n), 64, 60000).astype(int):
            msgs = []
            for _ in range(3):  # a long prompt, a short answer, three times
                msgs += [
                    {"role": "user", "content": text(int(total * 0.25))},
                    {"role": "assistant", "content": text(int(total * 0.08))},
                ]
            fm.write(json.dumps({"messages": msgs}) + "\n")
            ff.write(json.dumps({"text": template.render(msgs, False)}) + "\n")
    for fmt, (masked, flat) in out.items():
        for src, dst in ((base / "masked.jsonl", masked), (base / "flat.jsonl", flat)):
            cfg = PreprocessConfig(
                inputs=[str(src)], out=str(dst), format=fmt, chat_template=str(tpl),
                progress=False, overwrite=True,
            )  # fmt: skip
            preprocess(cfg, warn=lambda m: None)
    return out


def bench_masks(args) -> dict:
    """Fetch throughput with and without a loss mask, and the bytes a mask adds (docstring)."""
    from datapipe.fetch import FetchConfig
    from datapipe.index import read_index
    from datapipe.stream import StreamConfig

    res: dict = {}
    for fmt, (masked, flat) in make_mask_datasets(args.mask_samples).items():
        idx = {k: read_index(p) for k, p in (("masked", masked), ("flat", flat))}
        lengths = idx["masked"].num_tokens
        stream = StreamConfig(seed=0).build(lengths, args.budget)
        steps = [
            [rank_pieces(next(stream).sample_ids, lengths, args.ranks, 0)]
            for _ in range(args.steps)
        ]
        tokens = sum(int(p[0][:, 2].sum()) for p in steps)
        # masked; the same rows read without their mask; the flattened dataset
        fetchers = {
            "masked": FetchConfig(verify=False).build(str(masked)),
            "unmasked": FetchConfig(verify=False).build(str(masked)),
            "flat": FetchConfig(verify=False).build(str(flat)),
        }
        idx_plain = fetchers["unmasked"].index
        fetchers["unmasked"].index = dataclasses.replace(idx_plain, loss=None)
        best = dict.fromkeys(fetchers, float("inf"))
        try:
            for fetcher in fetchers.values():
                for mbs in steps[:2]:  # warm: page cache, the decoders chosen
                    fetcher.fetch_step(mbs)
            for _ in range(args.repeats):  # CPU time of every thread (pyarrow decodes in its own)
                for kind, fetcher in fetchers.items():
                    t0 = time.process_time()
                    for mbs in steps:
                        fetcher.fetch_step(mbs)
                    best[kind] = min(best[kind], time.process_time() - t0)
        finally:
            for fetcher in fetchers.values():
                fetcher.close()
        sizes = {k: sum(s["bytes"] for s in i.manifest["shards"]) for k, i in idx.items()}
        n_tokens = int(idx["masked"].manifest["num_tokens"])
        res[fmt] = {
            "tokens_per_s_masked": tokens / best["masked"],
            "tokens_per_s_unmasked": tokens / best["unmasked"],
            "tokens_per_s_flat": tokens / best["flat"],
            # the share of fetch throughput the mask costs
            "cost": 1.0 - best["unmasked"] / best["masked"],
            "cost_vs_flat": 1.0 - best["flat"] / best["masked"],
            "shard_bytes_per_token_added": (sizes["masked"] - sizes["flat"]) / n_tokens,
            "trained_share": idx["masked"].manifest["num_loss_tokens"] / n_tokens,
            "rows": int(idx["masked"].num_rows.sum()),
            "tokens_fetched": tokens,
        }
        r = res[fmt]
        print(
            f"{fmt:<8} fetch (M tokens per CPU second) {r['tokens_per_s_masked'] / 1e6:7.2f} with "
            f"the mask, {r['tokens_per_s_unmasked'] / 1e6:7.2f} the same rows without "
            f"(the mask costs {100 * r['cost']:.1f}% of it), {r['tokens_per_s_flat'] / 1e6:7.2f} the "
            f"flattened dataset ({100 * r['cost_vs_flat']:.1f}%); the mask adds "
            f"{r['shard_bytes_per_token_added']:.4f} shard bytes per token "
            f"({100 * r['trained_share']:.0f}% of tokens trained)"
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3, help="best of, interleaved")
    ap.add_argument("--budget", type=int, default=1 << 20, help="global batch tokens")
    ap.add_argument("--iterate", type=int, default=20_000, help="samples for baseline (a)")
    ap.add_argument("--fill-only", action="store_true", help="only batch formation (no dataset)")
    ap.add_argument("--mixture", action="store_true", help="mixture vs one dataset (no dataset)")
    ap.add_argument("--mix-samples", type=int, default=1_000_000, help="samples in all (--mixture)")
    ap.add_argument("--masks", action="store_true", help="loss-mask cost of the fetch (no stream)")
    ap.add_argument("--mask-samples", type=int, default=20_000, help="conversations (--masks)")
    args = ap.parse_args()
    if args.masks:
        OUT.mkdir(parents=True, exist_ok=True)
        res = bench_masks(args)
        (OUT / "bench_stream_masks.json").write_text(json.dumps(res, indent=1))
        print(f"wrote {OUT / 'bench_stream_masks.json'}")
        return
    if args.mixture:
        OUT.mkdir(parents=True, exist_ok=True)
        res = bench_mixture(args.mix_samples, args.budget, args.repeats)
        (OUT / "bench_stream_mixture.json").write_text(json.dumps(res, indent=1))
        print(f"wrote {OUT / 'bench_stream_mixture.json'}")
        return
    if args.fill_only:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "bench_stream_fill.json").write_text(json.dumps(bench_fill(args.repeats), indent=1))
        return

    t0 = time.perf_counter()
    root = make_dataset(args.samples)
    print(f"dataset {root} ready in {time.perf_counter() - t0:.1f}s")
    from datapipe.fetch import FetchConfig
    from datapipe.formats.mds import release_streaming_prefix
    from datapipe.index import read_index
    from datapipe.stream import StreamConfig

    index = read_index(root)
    lengths = index.num_tokens
    res: dict = {"args": vars(args), "stream": bench_stream(root, args.budget)}
    res["fill"] = bench_fill(args.repeats)

    # one rank's work for `steps` steps, from the real stream
    stream = StreamConfig(seed=0).open(str(root), args.budget)
    steps = [
        [rank_pieces(next(stream).sample_ids, lengths, args.ranks, 0)] for _ in range(args.steps)
    ]
    order = np.concatenate([p[0][:, 0] for p in steps])
    n_samples = len(order)
    tok_bytes = int(lengths[order].sum()) * 2
    rows: list[tuple[str, float, float, str]] = []

    def record(name: str, seconds: float, n: int, nbytes: int, note: str = "") -> None:
        rows.append((name, n / seconds, nbytes / seconds / 1e6, note))
        res[name] = {"samples_per_s": n / seconds, "MB_per_s": nbytes / seconds / 1e6, "n": n}

    # (c) memmap of the same bytes, same order
    import json as _json

    mds = _json.loads((root / "index.json").read_text())
    starts = index.shard_row_offsets
    paths, offs = [], []
    for sh in mds["shards"]:
        p = root / sh["raw_data"]["basename"]
        paths.append(p)
        nrow = sh["samples"]
        offs.append(np.fromfile(p, dtype="<u4", count=nrow + 2)[1:].astype(np.int64))
    grow = index.global_first_row[order]
    shard = np.searchsorted(starts, grow, side="right") - 1
    local = grow - starts[shard]

    def memmap_read() -> int:
        maps = [np.memmap(p, dtype=np.uint8, mode="r") for p in paths]  # fresh maps: cold works
        total = 0
        for sh, r in zip(shard.tolist(), local.tolist(), strict=True):
            o = offs[sh]
            total += np.array(maps[sh][o[r] : o[r + 1]]).nbytes
        del maps
        return total

    def run_memmap() -> tuple[float, int, int, dict]:
        t0 = time.perf_counter()
        memmap_read()
        return time.perf_counter() - t0, n_samples, tok_bytes, {}

    def run_fetch(access: str, direct: bool = True, cold: bool = False) -> tuple:
        fetcher = FetchConfig(mds_access=access).build(str(root))
        try:
            if not direct:
                fetcher.reader.direct = False
            # each shard's one-time XXH3 check on first open, before the clock (a long run pays
            # it once); it reads the whole file, so the cold case evicts again afterwards
            t0 = time.perf_counter()
            for i in range(len(fetcher.reader.shard_names)):
                fetcher.reader.shard_path(i)
            verify_s = time.perf_counter() - t0
            if cold:
                evict(root)
            t0 = time.perf_counter()
            for mbs in steps:
                fetcher.fetch_step(mbs)
            dt = time.perf_counter() - t0
            ratio = fetcher.reader.stats.bytes / tok_bytes
            return dt, n_samples, tok_bytes, {"bytes_ratio": ratio, "verify_s": verify_s}
        finally:
            fetcher.close()

    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = StreamingDataset(local=str(root), batch_size=1, shuffle=False)

    def run_getitem() -> tuple[float, int, int, dict]:
        t0 = time.perf_counter()
        nb = 0
        for r in grow.tolist():
            nb += ds.get_item(int(r))["tokens"].nbytes
        return time.perf_counter() - t0, n_samples, nb, {}

    variants = [
        ("(c) memmap", run_memmap, ""),
        ("(b) ds[i]", run_getitem, ""),
        ("fetch/reader", lambda c: run_fetch("reader", cold=c), "pread + direct token decode"),
        (
            "fetch/library",
            lambda c: run_fetch("reader", direct=False, cold=c),
            "pread + MDSReader.decode_sample",
        ),
        ("fetch/dataset", lambda c: run_fetch("dataset", cold=c), "StreamingDataset.get_item"),
    ]
    best: dict[str, tuple[float, int, int, dict, str]] = {}
    for _ in range(args.repeats):  # interleaved, best of `repeats`: the box is shared
        for name, fn, note in variants:
            for cold in (True, False):
                if cold:
                    evict(root)
                key = name + (" cold" if cold else "")
                out = fn(cold) if name.startswith("fetch") else fn()
                if key not in best or out[0] < best[key][0]:
                    best[key] = (*out, note)
    for key, (dt, n, nb, extra, note) in best.items():
        if "bytes_ratio" in extra:
            note = f"{note}; read/delivered bytes {extra['bytes_ratio']:.3f}"
        record(key, dt, n, nb, note)
        res[key].update(extra)

    evict(root)
    t0 = time.perf_counter()
    nb = k = 0
    it = iter(ds)
    for x in it:
        nb += x["tokens"].nbytes
        k += 1
        if k >= args.iterate:
            break
    record("(a) iterate cold", time.perf_counter() - t0, k, nb, "sequential, shuffle off")
    prefix = ds._shm_prefix_int
    it.close()
    del it
    ds = None
    time.sleep(1.0)  # the dataset's download thread notices the end, then its locks can go
    release_streaming_prefix(prefix)  # iteration leaves /tmp filelocks behind otherwise

    a = res["(a) iterate cold"]["samples_per_s"]
    c = res["(c) memmap"]["samples_per_s"]
    print(
        f"\nstream: {res['stream']['samples_per_s']:,.0f} samples/s over an epoch "
        f"({res['stream']['epoch_samples']:,} samples, budget {args.budget:,} tokens); "
        f"10M samples: epoch plan {res['stream']['big_epoch_plan_s']:.2f}s, "
        f"next() {res['stream']['big_next_ms']:.2f} ms"
    )
    print(
        f"one rank of {args.ranks}, {args.steps} steps: {n_samples:,} samples, {tok_bytes / 1e6:.1f} MB\n"
    )
    print(f"{'reader':<22}{'samples/s':>12}{'MB/s':>9}  {'vs (a)':>7}  {'vs (c)':>7}  note")
    for name, sps, mbs, note in rows:
        print(f"{name:<22}{sps:>12,.0f}{mbs:>9.1f}  {sps / a:>6.1f}x  {sps / c:>6.2f}x  {note}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_stream.json").write_text(json.dumps(res, indent=1))
    print(f"\nwrote {OUT / 'bench_stream.json'}")
    shutil.rmtree(OUT / "tmp", ignore_errors=True)


if __name__ == "__main__":
    main()
