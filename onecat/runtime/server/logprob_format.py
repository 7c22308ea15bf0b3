"""Token logprobs as OpenAI's response fields, in vLLM's shapes.

Chat (``choices[i].logprobs.content``): per token ``{token, logprob, bytes, top_logprobs}``,
``top_logprobs`` being the ``top_logprobs`` most likely tokens (each ``{token, logprob,
bytes}``). Completions (the legacy format, ``choices[i].logprobs``): parallel lists
``tokens``, ``token_logprobs``, ``top_logprobs`` (per token a dict: the chosen token, then the
``logprobs`` most likely ones, so up to logprobs + 1 entries, as OpenAI documents) and
``text_offset`` (where each token's string starts: the first at the length of the text sent
before, then the cumulative length of the token strings, as vLLM computes it).

A token's string is ``tokenizer.decode([id])`` (vLLM's choice; a partial UTF-8 character
decodes to U+FFFD), cached per id; without a tokenizer it is ``token_id:ID`` (vLLM's
``--return-tokens-as-token-ids`` form). Logprobs below -9999 (``-inf``) are reported as
-9999.0, which JSON can carry.
"""

from __future__ import annotations

from typing import Any

from onecat.runtime.layers.sampler import TokenLogprobs

FLOOR = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, FLOOR)


class LogprobFormatter:
    """Renders the engine's ``TokenLogprobs`` for one tokenizer."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """The string of one token id (cached)."""
        text = self._texts.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._texts[token_id] = text
        return text

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.token_text(token_id)
        return {"token": token, "logprob": _clamp(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}

    def chat_content(self, logprobs: list[TokenLogprobs]) -> list[dict[str, Any]]:
        """The ``logprobs.content`` entries of these tokens (chat)."""
        return [
            {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]

    def completion(self, logprobs: list[TokenLogprobs], text_offset: int) -> dict[str, list[Any]]:
        """The legacy ``logprobs`` object of these tokens; ``text_offset``: the first token's."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for lp in logprobs:
            token = self.token_text(lp.token_id)
            top = {token: _clamp(lp.logprob)}
            for token_id, value in lp.top:
                top.setdefault(self.token_text(token_id), _clamp(value))
            tokens.append(token)
            token_logprobs.append(_clamp(lp.logprob))
            tops.append(top)
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
