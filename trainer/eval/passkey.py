"""Synthetic passkey retrieval: a five-digit number hidden at a depth (0-100%) in repeated filler
text of a given length, then the question; the model should continue with the number. A case is
answered when the greedy prediction of every answer token is right (with the answer fed back one
token at a time, as teacher forcing gives: the same tokens greedy decoding would produce), and its
loss is the mean loss of the answer tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from datapipe.errors import ConfigError, MixlenError
from datapipe.ingest.tokenizer import Tokenizer

__all__ = ["PasskeyCase", "check_lengths", "make_cases"]

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it "
    "and memorize it; you will be asked about it.\n"
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyCase:
    """One case: its token ids (a document as the dataset stores one), where the answer's tokens
    start and how many there are, the hidden key, and the requested length and depth."""

    tokens: np.ndarray
    answer_start: int
    answer_len: int
    key: str
    length: int
    depth: float


def _plain(tok: Tokenizer, text: str) -> np.ndarray:
    """`text`'s ids as a document (BOS/EOS where the tokenizer adds them), without the EOS."""
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    if tok.eos_id is not None and ids.size and ids[-1] == tok.eos_id:
        ids = ids[:-1]
    return ids


def _case(tok: Tokenizer, units: int, depth: float, key: str, length: int) -> PasskeyCase:
    """The case with `units` filler lines, the needle after round(depth * units) of them."""
    at = int(round(depth * units))
    context = INTRO + FILLER * at + NEEDLE.format(key=key) + FILLER * (units - at) + QUESTION
    prompt = _plain(tok, context)
    full = _plain(tok, context + " " + key)
    if full.size <= prompt.size or not np.array_equal(full[: prompt.size], prompt):
        raise MixlenError(
            "passkey: the tokenizer does not keep the question's tokens when the answer follows "
            "(it merges across the boundary); use --no-passkey with this tokenizer"
        )
    return PasskeyCase(full, int(prompt.size), int(full.size - prompt.size), key, length, depth)


def _too_short(length: int, tokens: int, what: str) -> ConfigError:
    return ConfigError(
        f"{what}: {length:,} tokens is shorter than a passkey case without filler, {tokens:,} "
        f"tokens with this tokenizer (the introduction, the needle and the question); give "
        f"lengths of at least {tokens:,}, or --no-passkey"
    )


def _keys(lengths: list[int], depths: list[float], seed: int) -> list[tuple[int, float, str]]:
    """(length, depth, key) of every case: a random five-digit key each, in that order."""
    rng = np.random.default_rng(seed)
    return [(n, d, str(int(rng.integers(10_000, 100_000)))) for n in lengths for d in depths]


def check_lengths(
    tok: Tokenizer,
    lengths: list[int],
    depths: list[float],
    seed: int = 0,
    what: str = "--passkey-lengths",
) -> None:
    """ConfigError naming `what` for a length shorter than its cases without filler (with the
    keys `make_cases` draws: a key's digits may take more tokens than another's)."""
    for n, depth, key in _keys(lengths, depths, seed):
        tokens = _case(tok, 0, depth, key, 0).tokens.size
        if n < tokens:
            raise _too_short(n, tokens, what)


def make_cases(
    tok: Tokenizer,
    lengths: list[int],
    depths: list[float],
    seed: int = 0,
    what: str = "--passkey-lengths",
) -> list[PasskeyCase]:
    """A case per (length, depth): filler lines as many as keep the case within `length`
    tokens, a random five-digit key each (numpy generator seeded with `seed`); ConfigError
    naming `what` where even the case without filler is longer."""
    unit = max(_plain(tok, FILLER * 8).size - _plain(tok, "").size, 1) / 8
    base = _case(tok, 0, 0.0, "12345", 0).tokens.size
    out = []
    for length, depth, key in _keys(lengths, depths, seed):
        units = max(int((length - base) / unit), 1)
        case = _case(tok, units, depth, key, length)
        while case.tokens.size > length and units > 0:  # the estimate overshot: trim
            units = max(units - max(int((case.tokens.size - length) / unit), 1), 0)
            case = _case(tok, units, depth, key, length)
        if case.tokens.size > length:
            raise _too_short(length, case.tokens.size, what)
        out.append(case)
    return out
