"""What importing mosaicml-streaming costs a fresh process, with and without mixlen's stand-ins for
its dataset zoo (datapipe/libstreaming.py), side by side in one run.

  plain   `from streaming import MDSWriter, StreamingDataset` (the library's own import)
  mixlen  `import datapipe` first (which registers the stand-ins), then the same import

Each run is a fresh interpreter; the two alternate, `--repeats` of each. Reported: the process's
CPU seconds (user + sys, from the parent's view of its children) and wall seconds, medians, and
which of the zoo's heavy imports the process ended up holding.

usage: .venv/bin/python benchmarks/bench_imports.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = (
    "import json, sys; {first}from streaming import MDSWriter, StreamingDataset; "
    "print(json.dumps([m for m in ('transformers', 'transformers.models.auto', 'torchvision') "
    "if m in sys.modules]))"
)
VARIANTS = {"plain": "", "mixlen": "import datapipe; "}


def run_once(first: str) -> tuple[float, float, list[str]]:
    """CPU seconds, wall seconds and the heavy modules held, of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    runs: dict[str, list[tuple[float, float, list[str]]]] = {k: [] for k in VARIANTS}
    run_once("")  # page cache and bytecode warm for both
    for _ in range(args.repeats):
        for name, first in VARIANTS.items():
            runs[name].append(run_once(first))
    print(f"| import | CPU s (median of {args.repeats}) | wall s | heavy modules held |")
    print("| --- | ---: | ---: | --- |")
    cpu = {}
    for name, rs in runs.items():
        cpu[name] = statistics.median(r[0] for r in rs)
        wall = statistics.median(r[1] for r in rs)
        print(f"| {name} | {cpu[name]:.2f} | {wall:.2f} | {', '.join(rs[-1][2]) or 'none'} |")
    print(
        f"\nmixlen / plain CPU: {cpu['mixlen'] / cpu['plain']:.2f}x "
        f"(saves {cpu['plain'] - cpu['mixlen']:.2f} s per process)"
    )


if __name__ == "__main__":
    main()
