"""`make demo-extend`'s table: `mixlen eval` before and after the context extension, side by side.

usage: .venv/bin/python benchmarks/extend_report.py BEFORE/eval.json AFTER/eval.json [--out F.json]

Prints the loss by position bucket (the buckets beyond the short phase's 256 positions are the
ones the extension is for) and passkey accuracy by length, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def passkey_by_length(cases: list[dict]) -> dict[int, float]:
    """Share of passkey cases answered, by requested length."""
    out: dict[int, list[bool]] = {}
    for c in cases:
        out.setdefault(int(c["requested_length"]), []).append(bool(c["correct"]))
    return {k: sum(v) / len(v) for k, v in sorted(out.items())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    before, after = (json.loads(Path(p).read_text()) for p in (args.before, args.after))
    rows = []
    after_pos = {(r["start"], r["end"]): r for r in after["by_position"]}
    print("| positions | loss before | loss after | change | tokens |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in before["by_position"]:
        a = after_pos.get((r["start"], r["end"]))
        if a is None:
            continue
        rows.append({"start": r["start"], "end": r["end"], "before": r["loss"], "after": a["loss"]})
        change = a["loss"] - r["loss"]
        print(
            f"| {_k(r['start'])}-{_k(r['end'])} | {r['loss']:.3f} | {a['loss']:.3f} | "
            f"{change:+.3f} | {r['tokens']:,} |"
        )
    print(
        f"\nall positions: loss {before['loss']:.3f} -> {after['loss']:.3f} "
        f"(perplexity {math.exp(before['loss']):.1f} -> {math.exp(after['loss']):.1f})"
    )
    pk = {}
    if before.get("passkey") and after.get("passkey"):
        pb, pa = passkey_by_length(before["passkey"]), passkey_by_length(after["passkey"])
        print("\n| passkey length | answered before | answered after |\n| ---: | ---: | ---: |")
        for n in pb:
            print(f"| {n:,} | {pb[n]:.2f} | {pa.get(n, float('nan')):.2f} |")
        pk = {"before": pb, "after": pa}
    if args.out:
        Path(args.out).write_text(json.dumps({"by_position": rows, "passkey": pk}, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
