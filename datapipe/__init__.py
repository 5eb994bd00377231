"""Everything before the model: ingest, index, stream, packing, cost model, planner."""

__version__ = "0.1.0"
