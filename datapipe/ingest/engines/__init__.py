"""Ingest engines: one module per engine, chosen through `ENGINES` (a new engine is one module
and one entry). Each module has `write_dataset(run: base.EngineRun) -> base.EngineResult`, which
tokenizes the run's inputs and writes shards, index.parquet and manifest.json into the run's
temporary directory; what they share (bad-input notes, the no-samples error, the metadata write)
is in `base.py`. Ray is imported by the Ray engine when it runs."""

from __future__ import annotations

from datapipe.ingest.engines import local, ray
from datapipe.ingest.engines.base import Engine

ENGINES: dict[str, Engine] = {
    "local": local.write_dataset,  # this machine's processes
    "ray": ray.write_dataset,  # Ray Data tasks (pip install 'mixlen[ray]')
}
