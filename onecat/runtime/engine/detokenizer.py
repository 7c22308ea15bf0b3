"""Incremental detokenisation with stop strings.

Text is decoded from a window of recent tokens: the window's text minus the text of its
first (already emitted) tokens is the new text, held back while it ends in an incomplete
UTF-8 character (U+FFFD). Stop strings are searched in the new text plus the tail that
could start one; output is released only up to the point where no stop string can still
begin, so a stop string is never streamed and then taken back. A stop string counts only
when it ends in the text of a token after the first ``min_tokens`` (vLLM's rule).
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns the generated token ids of one sequence into text, piece by piece."""

    def __init__(self, tokenizer: Any | None, stop: list[str], min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.min_tokens = min_tokens
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._released = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def append(self, token_id: int) -> bool:
        """Add one generated token; True when its text completes a stop string (the text is
        then cut before the stop string)."""
        if self.tokenizer is None:
            return False
        self.token_ids.append(token_id)
        before = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        window = self._decode(self.token_ids[self._prefix_offset :])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return False
        old_length = len(self.text)
        self.text += window[len(before) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return False
        # only matches that end in the new text (each string's own window)
        hits = [self.text.find(s, max(0, old_length - len(s) + 1)) for s in self.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def release(self, final: bool) -> str:
        """Text not returned before; while running, the last ``hold_back`` characters (a
        possible start of a stop string) wait."""
        end = len(self.text) if final else max(self._released, len(self.text) - self.hold_back)
        piece = self.text[self._released : end]
        self._released = end
        return piece
