"""What a resumed run may change: the settings declared `free_on_resume` (how long a run lasts,
where it logs, and how, not what, a step computes: the planner's settings and the number of ranks
change which rank computes which tokens, not the loss or the gradients; the ZeRO level which rank
keeps which state; the emulated link only the time). Everything else must match the checkpoint."""

from __future__ import annotations

from typing import Any

from datapipe.settings import rows
from trainer.config.job import TrainerConfig

__all__ = ["resume_conflicts", "resume_free_keys"]


def resume_free_keys() -> frozenset[str]:
    """`section.key` of every setting a resumed run may change."""
    return frozenset(r.key for r in rows(TrainerConfig) if r.free_on_resume)


def resume_conflicts(saved: dict[str, dict[str, Any]], cfg: TrainerConfig) -> list[str]:
    """`section.key: saved -> now` for every run-defining setting that differs from `saved` (the
    checkpoint's `to_dict()`)."""
    free = resume_free_keys()
    out = []
    islands = (saved.get("parallel", {}).get("islands", 1), cfg.parallel.islands)
    for section, values in cfg.to_dict().items():
        if section == "co2" and islands == (1, 1):
            continue  # [co2] means nothing to a run of one island
        old = saved.get(section, {})
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in free and key in old and old[key] != value:
                out.append(f"{name}: {old[key]!r} -> {value!r}")
    return out
