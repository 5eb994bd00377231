"""mixlen's user-facing exceptions, and how config errors name the key the user wrote."""

from __future__ import annotations

from collections.abc import Mapping


class MixlenError(ValueError):
    """A user error: bad input, bad config, bad arguments. The CLI prints it without a traceback."""


class InputError(MixlenError):
    """Bad input data; the message names the file (and line) and what was expected."""


class ConfigError(MixlenError):
    """A bad configuration key or value; the message names the key."""


class PeerError(MixlenError):
    """Raised on the ranks that stop because another rank found an error and reported it: the
    command line exits with code 2 without printing it again."""


class UserKeys:
    """Mixin of the component config dataclasses (stream, fetch, planner): their errors name a
    setting the way the user wrote it. Each has a `keys` field mapping a field name to that
    spelling (`train.global_batch_tokens` in a TOML config, `--global-batch-tokens` on the
    command line); unmapped fields are named as they are."""

    keys: Mapping[str, str]

    def key(self, name: str) -> str:
        """How the user wrote field `name`."""
        return self.keys.get(name, name)
