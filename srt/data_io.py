"""The data files every stage shares (docs/design.md, "Data"): the record format and its
validation, a JSONL reader whose errors name the file, the line and the field, and atomic writers
(a temporary file, then a rename), so that a killed run never leaves half a file behind."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

# --------------------------------------------------------------------------------------------
# The data format (docs/design.md, "Data"). One record per annotated query turn.
# --------------------------------------------------------------------------------------------
RECORD_FIELDS = {
    "id": str,
    "source": str,
    "history": list,
    "query": str,
    "query_turn": int,
    "recall": list,
    "reasoning": str,
    "answer": str,
    "pruned": list,
    "meta": dict,
}
BUCKETS = (8, 16, 24, 32)  # Table 3 length buckets (rounds)


def bucket_of(num_rounds: int, buckets=BUCKETS) -> int:
    """Nearest bucket (ties go to the shorter one): 8-11 -> 8, 12-19 -> 16, 20-27 -> 24, 28+ -> 32."""
    return min(buckets, key=lambda b: (abs(num_rounds - b), b))


class DataError(ValueError):
    """A malformed input record; the message names the file, the line and the field."""


def validate_record(record, path="<record>", line=0) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"{path}:{line}: record is not a JSON object")
    for field, kind in RECORD_FIELDS.items():
        if field not in record:
            raise DataError(f"{path}:{line}: field '{field}' is missing")
        if not isinstance(record[field], kind) or (kind is int and isinstance(record[field], bool)):
            raise DataError(
                f"{path}:{line}: field '{field}' must be {kind.__name__}, got {type(record[field]).__name__}"
            )
    labels = set()
    for k, turn in enumerate(record["history"]):
        if not isinstance(turn, dict) or not all(
            isinstance(turn.get(f), str) for f in ("label", "speaker", "text")
        ):
            raise DataError(f"{path}:{line}: field 'history[{k}]' needs string label, speaker and text")
        labels.add(turn["label"])
    for field in ("recall", "pruned"):
        missing = [x for x in record[field] if x not in labels]
        if missing:
            raise DataError(f"{path}:{line}: field '{field}' names {missing[0]!r}, which is not in history")
    return record


def read_lines(path, parse, on_error="raise", errors=None) -> list:
    """Parse a JSONL file line by line with `parse(obj, path, line)`. A bad line raises DataError
    naming file, line and field; with on_error='skip' it is skipped and its message appended to
    `errors`."""
    items = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno})")
                items.append(parse(obj, path, line_no))
            except DataError as e:
                if on_error != "skip":
                    raise
                if errors is not None:
                    errors.append(str(e))
    return items


def read_jsonl(path, validate=True, on_error="raise", errors=None) -> list[dict]:
    """Read stage-0 records, one per line (see RECORD_FIELDS)."""
    return read_lines(path, validate_record if validate else (lambda obj, *_: obj), on_error, errors)


def atomic_write_text(path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename: a killed run never leaves a
    half-written file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes owner-only files; outputs are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def finite_or_none(value):
    """NaN and inf are not JSON: they are written as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_jsonl(path, records) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
