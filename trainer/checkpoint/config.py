"""`[checkpoint]`: where and how often DCP checkpoints are written, and what a run resumes from."""

from __future__ import annotations

from dataclasses import dataclass

from datapipe.errors import ConfigError
from datapipe.settings import Names, setting

__all__ = ["CheckpointConfig"]


@dataclass
class CheckpointConfig:
    """`[checkpoint]`: DCP checkpoints in `dir`/step-NNNNNNNN."""

    dir: str | None = setting(
        None, help="checkpoint directory (none: no checkpoints)", free_on_resume=True
    )
    interval: int = setting(
        0, help="save every this many steps (0: only at the end)", lo=0, free_on_resume=True
    )
    resume: bool | str = setting(
        False,
        help="true: resume from the newest complete checkpoint in dir; or a step directory",
        free_on_resume=True,
    )
    keep: int = setting(
        2, help="complete checkpoints kept (older ones are deleted)", lo=1, free_on_resume=True
    )

    def validate(self, names: Names) -> None:
        if self.resume is True and not self.dir:
            raise ConfigError(f"{names('resume')}: needs {names('dir')} (or a checkpoint path)")
