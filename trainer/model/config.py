"""`[model]`: the network a run trains, a named shape (datapipe.shapes.MODEL_CONFIGS) with fields
optionally replaced, and the compute dtypes a run may use."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from datapipe.errors import ConfigError
from datapipe.settings import Names, setting
from datapipe.shapes import DTYPES, MODEL_CONFIGS, ModelConfig, get_config

__all__ = ["DTYPES", "ModelSection"]

_SHAPE_HELP = "replaces the named shape's value (default: the shape's own)"


@dataclass
class ModelSection:
    """`[model]`: a named shape, optionally with fields replaced."""

    name: str = setting("debug", help="a named shape", choices=tuple(MODEL_CONFIGS))
    vocab_size: int | None = setting(
        None,
        help="vocabulary size, e.g. a BPE tokenizer's (the dataset's manifest vocab_size)",
        lo=1,
    )
    dim: int | None = setting(None, help=f"model width; {_SHAPE_HELP}", lo=1, hi=1 << 20)
    n_layers: int | None = setting(None, help=f"decoder blocks; {_SHAPE_HELP}", lo=1, hi=1 << 12)
    n_heads: int | None = setting(None, help=f"query heads; {_SHAPE_HELP}", lo=1, hi=1 << 12)
    n_kv_heads: int | None = setting(None, help=f"key/value heads; {_SHAPE_HELP}", lo=1, hi=1 << 12)
    ffn_dim: int | None = setting(
        None, help=f"SwiGLU hidden width; {_SHAPE_HELP}", lo=1, hi=1 << 22
    )

    def validate(self, names: Names) -> None:
        self.shape(names)

    def overrides(self) -> dict[str, int]:
        """The shape fields this section replaces."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "name" and getattr(self, f.name) is not None
        }

    def shape(self, names: Names | None = None) -> ModelConfig:
        """The model's shape, with the overrides applied."""
        names = names or Names("model")
        try:
            return get_config(self.name, **self.overrides())
        except ValueError as exc:  # shape constraints between fields (heads, head dim)
            keys = ", ".join(names(k) for k in self.overrides()) or names("name")
            raise ConfigError(f"{keys}: {exc}") from None
