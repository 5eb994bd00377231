"""mixlen's user-facing exceptions."""

from __future__ import annotations


class MixlenError(ValueError):
    """A user error: bad input, bad config, bad arguments. The CLI prints it without a traceback."""


class InputError(MixlenError):
    """Bad input data; the message names the file (and line) and what was expected."""


class ConfigError(MixlenError):
    """A bad configuration key or value; the message names the key."""
