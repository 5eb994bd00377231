"""Hugging Face `datasets` exports as inputs, read with pyarrow only (no `datasets` at run time).

A `Dataset.save_to_disk` folder holds `state.json` (its Arrow files, in dataset order, under
`_data_files`), `dataset_info.json` (the features) and `data-NNNNN-of-NNNNN.arrow` files in the
Arrow IPC *stream* format. A `DatasetDict` folder holds `dataset_dict.json` and one such folder per
split; mixlen takes one split at a time (name it). Parquet exports (`Dataset.to_parquet`, the Hub's
parquet conversion) are plain parquet files and need nothing special.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from datapipe.errors import InputError
from datapipe.files import CONFIG_FILE_LIMIT, not_regular_reason, read_bounded_text
from datapipe.ingest.rows import SFT_FIELDS, row_kind

STATE_FILE = "state.json"
INFO_FILE = "dataset_info.json"
DICT_FILE = "dataset_dict.json"


def is_saved_dataset(folder: str | os.PathLike) -> bool:
    """True for a `save_to_disk` folder of one Dataset (state.json + dataset_info.json)."""
    return os.path.isfile(os.path.join(folder, STATE_FILE)) and os.path.isfile(
        os.path.join(folder, INFO_FILE)
    )


def check_not_dataset_dict(folder: str | os.PathLike) -> None:
    """InputError for a DatasetDict folder: mixlen reads one split, named by its folder."""
    path = os.path.join(folder, DICT_FILE)
    if not os.path.isfile(path):
        return
    try:
        splits = json.loads(read_bounded_text(path, CONFIG_FILE_LIMIT, DICT_FILE)).get("splits", [])
    except (OSError, ValueError, AttributeError):
        splits = []
    names = ", ".join(str(s) for s in splits) or "?"
    first = os.path.join(os.fspath(folder), str(splits[0])) if splits else f"{folder}/SPLIT"
    raise InputError(
        f"{folder}: a DatasetDict with splits {names}; give one split's folder, e.g. {first}"
    )


def arrow_files(folder: str | os.PathLike) -> list[str]:
    """The folder's Arrow files in dataset order (state.json `_data_files`)."""
    path = os.path.join(folder, STATE_FILE)
    try:
        state = json.loads(read_bounded_text(path, CONFIG_FILE_LIMIT, STATE_FILE))
        files = [d["filename"] for d in state["_data_files"]]
    except InputError:
        raise
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read the saved dataset's state ({exc})") from None
    except (KeyError, TypeError):
        raise InputError(f"{path}: expected '_data_files': [{{'filename': ...}}, ...]") from None
    if state.get("_indices_data_files"):
        raise InputError(
            f"{folder}: saved with an indices mapping; save it again after flatten_indices()"
        )
    out = []
    for name in files:
        if os.path.isabs(name) or ".." in Path(name).parts:
            raise InputError(f"{path}: data file {name!r} is outside the folder")
        out.append(os.path.join(os.fspath(folder), name))
    return out


def folder_bytes(folder: str | os.PathLike) -> int:
    """Bytes of the folder's Arrow files (0 for files that cannot be listed)."""
    total = 0
    for p in arrow_files(folder):
        try:
            total += os.path.getsize(p)
        except OSError:
            pass
    return total


def iter_saved_dataset(
    folder: Path, text_field: str, block_type: type, batch_rows: Callable[[float], int]
) -> Iterator:
    """Blocks of `text_field` values (kind "parquet": a value list, `start` the dataset row), or
    of conversation / prompt-completion rows (kind "rows": dicts of their fields, when the dataset
    has `messages` or `prompt` and `completion`), in dataset order, `batch_rows(bytes per value)`
    rows at a time; an unreadable file, one that is not a regular file or a missing column is an
    "error" block naming it."""
    import pyarrow as pa

    row = 0
    for path in arrow_files(folder):
        try:
            problem = not_regular_reason(path)  # checked first: mapping a FIFO would block
        except OSError as exc:
            problem = f"cannot read Arrow file: {exc.strerror or exc}"
        if problem:
            yield block_type("error", path, error=problem)
            return
        try:
            with pa.memory_map(path) as src:
                reader = pa.ipc.open_stream(src)  # save_to_disk writes the IPC stream format
                names = reader.schema.names
                kind = row_kind(names, text_field)
                if kind is None:
                    yield block_type(
                        "error",
                        path,
                        error=f"missing text field {text_field!r} (columns: {', '.join(names)}); "
                        "instruction data has messages, or prompt and completion",
                    )
                    return
                fields = [text_field] if kind == "text" else [f for f in SFT_FIELDS if f in names]
                for batch in reader:
                    batch = batch.select(fields)
                    rows = batch_rows(batch.nbytes / max(1, batch.num_rows))
                    for lo in range(0, batch.num_rows, rows):
                        part = batch.slice(lo, rows)
                        if kind == "text":
                            values = part.column(0).to_pylist()
                            yield block_type(
                                "parquet", str(folder), start=row, items=values, nbytes=part.nbytes
                            )
                        else:
                            values = part.to_pylist()
                            yield block_type("rows", str(folder), start=row, items=values,
                                             nbytes=part.nbytes, row_kind=kind)  # fmt: skip
                        row += len(values)
        except (OSError, pa.ArrowInvalid) as exc:
            yield block_type("error", f"{path}", error=f"cannot read Arrow file: {exc}")
            return
