"""Calibration sources: every kind reads, sampling is deterministic, bad sources fail clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onecat.errors import OnecatError
from onecat.quantize.calibration import calibration_tokens, read_documents


class WordTokenizer:
    """One token per whitespace-separated word: enough to test the cutting logic."""

    def __call__(self, text: str, add_special_tokens: bool = False, verbose: bool = False):
        return {"input_ids": [len(w) for w in text.split()]}


TOK = WordTokenizer()


def test_builtin_pydoc_is_deterministic_and_spread() -> None:
    a = calibration_tokens(TOK, "builtin:pydoc", 16, 64)
    b = calibration_tokens(TOK, "builtin:pydoc", 16, 64)
    assert a.shape == (16, 64) and a.dtype.is_floating_point is False
    assert (a == b).all()
    assert len({tuple(row.tolist()) for row in a}) == 16  # distinct windows


def test_text_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("beta " * 50)
    (tmp_path / "d" / "a.txt").write_text("alpha " * 50)
    docs = read_documents(str(tmp_path / "d"))
    assert docs[0].startswith("alpha") and docs[1].startswith("beta")  # sorted by path
    assert calibration_tokens(TOK, str(tmp_path / "d" / "a.txt"), 5, 10).shape == (5, 10)


def test_jsonl_with_field(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"content": f"word{i} " * 20, "id": i}) for i in range(5)))
    assert calibration_tokens(TOK, f"{path}:content", 10, 10).shape == (10, 10)
    with pytest.raises(OnecatError, match="no field 'text'.*content"):
        read_documents(str(path))


def test_parquet_with_field(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": ["lorem ipsum " * 30] * 3}), path)
    assert calibration_tokens(TOK, f"{path}:body", 4, 20).shape == (4, 20)


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(OnecatError, match="does not exist"):
        calibration_tokens(TOK, str(tmp_path / "nope.txt"), 2, 8)


def test_empty_source(tmp_path: Path) -> None:
    path = tmp_path / "empty.txt"
    path.write_text("  \n\n ")
    with pytest.raises(OnecatError, match="is empty"):
        calibration_tokens(TOK, str(path), 2, 8)


def test_source_shorter_than_asked(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("one two three " * 10)  # 30 tokens
    with pytest.raises(OnecatError) as err:
        calibration_tokens(TOK, str(path), 4, 10)
    msg = str(err.value)
    assert "too short" in msg and "30 tokens" in msg and "4 were asked" in msg


def test_unknown_builtin() -> None:
    with pytest.raises(OnecatError, match="builtin:pydoc"):
        read_documents("builtin:wiki")
