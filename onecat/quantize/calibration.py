"""Calibration text sources and their deterministic cut into token samples.

A SOURCE is one of:

- ``builtin:pydoc``: the Python standard library's pydoc topics (offline default);
- a text file, or a directory of text files (read in sorted path order);
- ``FILE.jsonl`` or ``FILE.jsonl:FIELD``: one JSON object per line, text in FIELD
  (default ``text``);
- ``FILE.parquet`` or ``FILE.parquet:FIELD``: a string column (default ``text``; needs pyarrow);
- ``hf:NAME[,CONFIG][@SPLIT][:FIELD]``: a ``datasets`` dataset, streamed (online; default
  split ``train``, field ``text``).

Documents are joined by blank lines, tokenized once, cut into non-overlapping windows of
``seqlen`` tokens, and ``samples`` windows are taken evenly spaced over the whole text: no
random numbers, so two runs (and a resumed run) see exactly the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from onecat.errors import OnecatError
from onecat.texts import pydoc_documents

BUILTIN_PYDOC = "builtin:pydoc"


def pydoc_text() -> str:
    """The pydoc topics joined by blank lines: ``builtin:pydoc`` as one text (``onecat eval``'s
    default text, and the tiny models' tokenizer training text)."""
    return "\n\n".join(pydoc_documents())


def _split_field(source: str, suffix: str) -> tuple[Path, str]:
    """``data.jsonl:content`` -> (Path("data.jsonl"), "content"); no field -> "text"."""
    marker = source.lower().rfind(suffix)
    path, rest = source[: marker + len(suffix)], source[marker + len(suffix) :]
    if rest and not rest.startswith(":"):
        raise OnecatError(f"calibration source {source!r}: write FILE{suffix}:FIELD")
    return Path(path), rest[1:] or "text"


def _jsonl_documents(path: Path, fieldname: str) -> list[str]:
    docs = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise OnecatError(f"calibration file {path}, line {lineno}: invalid JSON ({exc})") from exc
            if not isinstance(record, dict) or fieldname not in record:
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise OnecatError(
                    f"calibration file {path}, line {lineno}: no field {fieldname!r} (found: {keys}); "
                    f"pass {path}:FIELD to choose the text field"
                )
            if not isinstance(record[fieldname], str):
                raise OnecatError(f"calibration file {path}, line {lineno}: field {fieldname!r} is not text")
            docs.append(record[fieldname])
    return docs


def _parquet_documents(path: Path, fieldname: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise OnecatError("reading .parquet calibration needs pyarrow: pip install pyarrow") from exc
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for damaged files
        raise OnecatError(f"calibration file {path} is not a readable parquet file: {exc}") from exc
    if fieldname not in table.column_names:
        raise OnecatError(
            f"calibration file {path}: no column {fieldname!r} (columns: "
            f"{', '.join(table.column_names)}); pass {path}:COLUMN"
        )
    return [t for t in table.column(fieldname).to_pylist() if isinstance(t, str)]


def _text_documents(path: Path) -> list[str]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    docs = []
    for file in files:
        try:
            docs.append(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise OnecatError(f"calibration file {file} is not UTF-8 text: {exc}") from exc
    return docs


def _hf_documents(spec: str, enough_chars: int) -> list[str]:
    """``NAME[,CONFIG][@SPLIT][:FIELD]`` streamed until about ``enough_chars`` characters."""
    name, _, fieldname = spec.partition(":")
    name, _, split = name.partition("@")
    name, _, config = name.partition(",")
    try:
        import datasets
    except ImportError as exc:
        raise OnecatError("hf: calibration sources need the datasets package: pip install datasets") from exc
    try:
        stream = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
        docs, total = [], 0
        for record in stream:
            text = record.get(fieldname or "text")
            if not isinstance(text, str):
                raise OnecatError(f"dataset {name}: records have no text field {fieldname or 'text'!r}")
            docs.append(text)
            total += len(text)
            if total >= enough_chars:
                break
    except OnecatError:
        raise
    except Exception as exc:
        raise OnecatError(
            f"could not read dataset {name!r} ({exc}); offline, use --calib builtin:pydoc or a local file"
        ) from exc
    return docs


def read_documents(source: str, *, enough_chars: int = 50_000_000) -> list[str]:
    """Read the documents of a calibration SOURCE (see the module docstring)."""
    if source == BUILTIN_PYDOC:
        return pydoc_documents()
    if source.startswith("hf:"):
        return _hf_documents(source[3:], enough_chars)
    if source.startswith("builtin:"):
        raise OnecatError(f"unknown calibration source {source!r}; the builtin one is {BUILTIN_PYDOC}")
    lowered = source.lower()
    if ".jsonl" in lowered and not Path(source).exists():
        path, fieldname = _split_field(source, ".jsonl")
    elif ".parquet" in lowered and not Path(source).exists():
        path, fieldname = _split_field(source, ".parquet")
    else:
        path, fieldname = Path(source), "text"
    if not path.exists():
        raise OnecatError(
            f"calibration source {path} does not exist; pass a text file or directory, "
            f"FILE.jsonl[:FIELD], FILE.parquet[:FIELD], hf:NAME or {BUILTIN_PYDOC}"
        )
    if path.suffix.lower() == ".jsonl":
        return _jsonl_documents(path, fieldname)
    if path.suffix.lower() == ".parquet":
        return _parquet_documents(path, fieldname)
    return _text_documents(path)


def calibration_tokens(tokenizer, source: str, samples: int, seqlen: int) -> torch.Tensor:
    """Token ids [samples, seqlen] (int64) cut deterministically from SOURCE.

    Raises OnecatError when the source is missing, empty, or holds fewer than
    ``samples * seqlen`` tokens.
    """
    if samples <= 0 or seqlen <= 0:
        raise OnecatError(f"calibration needs positive --samples and --seqlen, got {samples} x {seqlen}")
    docs = [d for d in read_documents(source, enough_chars=samples * seqlen * 8) if d.strip()]
    if not docs:
        raise OnecatError(f"calibration source {source!r} is empty: it holds no text")
    text = "\n\n".join(docs)
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    windows = len(ids) // seqlen
    if windows < samples:
        raise OnecatError(
            f"calibration source {source!r} is too short: {len(ids)} tokens give {windows} "
            f"samples of {seqlen}, but {samples} were asked; pass more text, or lower "
            f"--samples / --seqlen"
        )
    starts = [(i * windows // samples) * seqlen for i in range(samples)]
    tokens = torch.tensor(ids, dtype=torch.int64)
    return torch.stack([tokens[s : s + seqlen] for s in starts])
