"""mixlen's user-facing exceptions (how config errors name the key the user wrote: datapipe.settings)."""

from __future__ import annotations


class MixlenError(ValueError):
    """A user error: bad input, bad config, bad arguments. The CLI prints it without a traceback."""


# what a data error advises when the whole dataset is worth checking (verify leaves it out)
VERIFY_ADVICE = "run `mixlen verify`"


class InputError(MixlenError):
    """Bad input data; the message names the file (and line) and what was expected. `advice`,
    when given, follows the message after a semicolon (`message`: the message alone)."""

    def __init__(self, message: str, advice: str | None = None) -> None:
        super().__init__(f"{message}; {advice}" if advice else message)
        self.message = message
        self.advice = advice


class ConfigError(MixlenError):
    """A bad configuration key or value; the message names the key."""


class PeerError(MixlenError):
    """Raised on the ranks that stop because another rank found an error and reported it: the
    command line exits with code 2 without printing it again."""


class StoreError(MixlenError):
    """An object store refused or could not be reached; the message names the URI and why.
    `kind`: "denied", "no_bucket", "not_found", "unreachable" (worth retrying), "refused" or
    "scheme"."""

    def __init__(self, message: str, kind: str = "refused") -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def transient(self) -> bool:
        return self.kind == "unreachable"
