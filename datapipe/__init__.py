"""Everything before the model: ingest, index, stream, packing, cost model, planner."""

from datapipe.libstreaming import light_streaming

__version__ = "0.1.0"

# before any module of this package imports mosaicml-streaming: its dataset zoo stays unimported
light_streaming()
