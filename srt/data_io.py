"""The data files every stage shares (docs/design.md, "Data"): the record format and its
validation, a JSONL reader whose errors name the file, the line and the field, the training mix of
several files with a weight each (`--data a.jsonl:0.5 b.jsonl:0.5`), and atomic writers (a
temporary file, then a rename), so that a killed run never leaves half a file behind."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
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
# The longest utterance (history turn, query or answer) a record may hold, in characters. About
# 5,000 tokens: more than the longest --max-length of any preset (4096), so such an utterance could
# never be shown whole in a prompt, and one of megabytes would only make stage 1 tokenize and fit
# it for minutes before dropping it. The corpora's longest (a CoQA story) is about 8,000.
MAX_UTTERANCE_CHARS = 20_000


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
    if record["query_turn"] < 1:  # Q1 is a dialogue's first round: a turn before it names nothing
        raise DataError(f"{path}:{line}: field 'query_turn' must be >= 1, got {record['query_turn']}")
    labels = set()
    for k, turn in enumerate(record["history"]):
        if not isinstance(turn, dict) or not all(
            isinstance(turn.get(f), str) for f in ("label", "speaker", "text")
        ):
            raise DataError(f"{path}:{line}: field 'history[{k}]' needs string label, speaker and text")
        if turn["label"] in labels:  # a <HIS> tag names one turn by its label: two would be one guess
            taken = f"{turn['label']!r} is the label of an earlier turn"
            raise DataError(f"{path}:{line}: field 'history[{k}].label' {taken}")
        labels.add(turn["label"])
        if len(turn["text"]) > MAX_UTTERANCE_CHARS:
            raise DataError(f"{path}:{line}: field 'history[{k}].text' {too_long(turn['text'])}")
    for field in ("query", "answer"):
        if len(record[field]) > MAX_UTTERANCE_CHARS:
            raise DataError(f"{path}:{line}: field '{field}' {too_long(record[field])}")
    keys = record.get("answer_keys", [])  # optional; a key is a short fact as text ("$106", "yes")
    if not isinstance(keys, (list, str)):
        raise DataError(
            f"{path}:{line}: field 'answer_keys' must be a list of strings, got {type(keys).__name__}"
        )
    for k, key in enumerate([] if isinstance(keys, str) else keys):
        if not isinstance(key, str):
            raise DataError(
                f"{path}:{line}: field 'answer_keys[{k}]' must be a string, got {type(key).__name__}"
            )
    for field in ("recall", "pruned"):
        missing = [x for x in record[field] if x not in labels]
        if missing:
            raise DataError(f"{path}:{line}: field '{field}' names {missing[0]!r}, which is not in history")
    return record


def too_long(text: str) -> str:
    return f"holds {len(text):,} characters, more than the {MAX_UTTERANCE_CHARS:,} an utterance may have"


def not_utf8(path, line_no: int, line: bytes, error: UnicodeDecodeError) -> DataError:
    """The error of a line that is not UTF-8 (a Latin-1 or Windows-1252 export, say); `error.start`
    is the offset of the bad byte in `line`."""
    byte = line[error.start : error.start + 1].hex()
    return DataError(
        f"{path}:{line_no}: not valid UTF-8 (byte 0x{byte} at column {error.start + 1}); "
        "save the file as UTF-8"
    )


# The byte order mark Notepad and Excel put before a UTF-8 file: not part of its first line.
UTF8_BOM = b"\xef\xbb\xbf"


def decode_utf8(data: bytes, path) -> str:
    """A whole file's bytes as text (a leading byte order mark dropped); bad bytes raise DataError
    naming the file and the line."""
    data = data.removeprefix(UTF8_BOM)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    for line_no, line in enumerate(data.split(b"\n"), 1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise not_utf8(path, line_no, line, e) from None
    raise DataError(f"{path}: not valid UTF-8; save the file as UTF-8")  # a character split by a newline


def read_lines(path, parse, on_error="raise", errors=None) -> list:
    """Parse a JSONL file line by line with `parse(obj, path, line)`. A bad line (not UTF-8, not
    JSON, or refused by `parse`) raises DataError naming file, line and field; with
    on_error='skip' it is skipped and its message appended to `errors`. The file is read as bytes
    and each line decoded alone, so one undecodable line is one bad line, not a failed file."""
    items = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(
            f"{path}: {'no such file' if isinstance(e, FileNotFoundError) else e.strerror}"
        ) from None
    with f:
        for line_no, raw in enumerate(f, 1):
            if line_no == 1:
                raw = raw.removeprefix(UTF8_BOM)
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise not_utf8(path, line_no, raw, e) from None
                if not line.strip():
                    continue
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


def read_unique_records(path) -> list[dict]:
    """read_jsonl for a file whose rows are kept by id (an evaluation's answers): a second record
    under one id would replace the first's answer and be counted twice, so it is refused, naming
    both lines."""
    line_of = {}

    def parse(obj, path, line):
        record = validate_record(obj, path, line)
        if record["id"] in line_of:
            raise DataError(
                f"{path}:{line}: field 'id' {record['id']!r} is also the id of line {line_of[record['id']]}; "
                "give each record an id of its own"
            )
        line_of[record["id"]] = line
        return record

    return read_lines(path, parse)


# --------------------------------------------------------------------------------------------
# A training mix: several record files, a weight each. `--data a.jsonl` (one file) trains on its
# records exactly as before; `--data syn/train.jsonl:0.5 locomo/train.jsonl:0.5` on a mix.
# --------------------------------------------------------------------------------------------
def parse_data_spec(spec: str) -> tuple[str, float]:
    """'PATH:WEIGHT' -> (PATH, WEIGHT); a bare PATH has weight 1. A weight is a finite number > 0.
    A path may hold a colon itself (a run named run:1): the whole text is a PATH when it names a
    file, or when what follows its last colon holds a '/' (a folder, never a weight)."""
    path, colon, weight = str(spec).rpartition(":")
    if not colon or "/" in weight or os.path.isfile(spec):
        return str(spec), 1.0
    try:
        value = float(weight)
    except ValueError:
        value = float("nan")
    if not path or not math.isfinite(value) or value <= 0:
        raise DataError(f"{spec!r} is not PATH or PATH:WEIGHT with WEIGHT a number > 0")
    return path, value


def data_spec(text: str) -> str:
    """argparse type of --data: checks PATH[:WEIGHT] and keeps the text as given."""
    try:
        parse_data_spec(text)
    except DataError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def data_paths(specs) -> list[str]:
    """The files of --data (a string or a list of PATH[:WEIGHT])."""
    return [parse_data_spec(spec)[0] for spec in ([specs] if isinstance(specs, str) else specs)]


def mix_sources(sources, seed: int) -> list[dict]:
    """[(records, weight), ...] -> the records of one epoch of the mix, source after source (the
    stages shuffle them). One source: its records, untouched, so a one-file run is what it always
    was. Several: N = the records of all sources together, and source i fills round(N * w_i / W)
    of the N places (W = the sum of the weights; at least one place, so every source is seen).
    A source fills its places from seeded permutations of its records, every record once before
    any twice: a source smaller than its share repeats, a larger one gives a seeded subset (the
    same every epoch: give it a weight of at least its share of N to train on all of it)."""
    if len(sources) == 1:
        return sources[0][0]
    total, weights = sum(len(records) for records, _ in sources), sum(w for _, w in sources)
    mix = []
    for i, (records, weight) in enumerate(sources):
        places, rng, order = max(1, round(total * weight / weights)), random.Random(f"mix-{seed}-{i}"), []
        while len(order) < places:
            order += rng.sample(range(len(records)), len(records))
        mix += [records[k] for k in order[:places]]
    return mix


def read_mixture(specs, seed: int = 0, keep=None, note: str = "", unique: bool = False) -> list[dict]:
    """The training records of --data (a string or a list of PATH[:WEIGHT]): mix_sources over the
    files, read with read_jsonl (read_unique_records when `unique`: a record under a second id is
    a copy that would weigh twice). `keep(record)` filters each file before the mix (stage 2's
    --train-turns), so the weights apply to what trains; a file left empty is an error (`note`
    says why it may be)."""
    sources = []
    for spec in [specs] if isinstance(specs, str) else specs:
        path, weight = parse_data_spec(spec)
        records = read_unique_records(path) if unique else read_jsonl(path)
        if keep is not None:
            records = [r for r in records if keep(r)]
        if not records:
            raise DataError(f"{path}: no records{note}")
        sources.append((records, weight))
    if not sources:
        raise DataError("--data names no file")
    return mix_sources(sources, seed)


def files_sha256(paths) -> str:
    """One sha256 over the bytes of `paths`, in order, read in blocks (a training file can be large):
    what a resumed run checks to know it reads the same data."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")  # file boundaries count: a|bc is not ab|c
    return digest.hexdigest()


def folder_write_error(folder) -> str | None:
    """Why no file can be written in `folder` (made if missing), or None: found by making the folder
    and a file in it, since as root a read-only folder passes os.access. Asked before a run's work,
    so that the work is not lost to a folder it cannot be written to."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def atomic_write_text(path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename: a killed run never leaves a
    half-written file behind."""
    atomic_write_texts({path: text})


def atomic_write_texts(files: dict) -> None:
    """{path: text}: every file written to a temporary file beside it first, then all renamed. A
    write that fails (a full disk) leaves every earlier file as it was, not one new file beside
    an old one. The OSError names the file it was writing."""
    staged, path = [], None
    try:
        for path, text in files.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            staged.append((tmp, path))
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, 0o644)  # mkstemp makes owner-only files; outputs are meant to be shared
        for tmp, path in staged:
            os.replace(tmp, path)
    except BaseException as e:
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None and path is not None:  # a write names no file
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def finite_or_none(value):
    """NaN and inf are not JSON: they are written as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_jsonl(path, records) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
