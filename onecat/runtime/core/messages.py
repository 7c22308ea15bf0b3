"""The messages between the API process and an engine-core process (msgspec, MessagePack).

Into the core (one PULL socket): ``AddRequests``, ``AbortRequests``, ``Shutdown``.
Out of the core (one PUSH socket): ``Ready`` once the engine is built, ``Outputs`` after
each engine step that produced any (with a stats snapshot at most every
``STATS_INTERVAL`` seconds), ``Failed`` when the engine failed (the core exits after it).

A request's sampling settings travel as ``SamplingParams``' plain fields; its grammar mask
(the only logits processor the server makes) as xgrammar's serialised compiled grammar,
rebuilt in the core against its own tokenizer table.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import msgspec

from onecat.runtime.engine.llm_engine import RequestOutput
from onecat.runtime.sampling_params import SamplingParams

STATS_INTERVAL = 0.05
"""Seconds between two stats snapshots sent by a busy core (an idle core sends one when it
goes idle)."""

_PLAIN_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name != "logits_processors")


class NewRequest(msgspec.Struct, array_like=True):
    """One request for the core: ``params`` are SamplingParams' plain fields."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    grammar: str | None = None


class AddRequests(msgspec.Struct, tag="add"):
    """Requests added together, before the core's next step."""

    requests: list[NewRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    """Requests to stop now (their KV blocks and state slots are freed)."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop the engine and exit."""


class Ready(msgspec.Struct, tag="ready"):
    """The engine is built and warmed up; what the API process needs to know about it."""

    pid: int
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    kv_block_size: int


class Outputs(msgspec.Struct, tag="outputs"):
    """One engine step's outputs (token ids only: ``new_text`` is empty) and, when due, the
    engine's ``stats()``."""

    outputs: list[RequestOutput]
    stats: dict[str, Any] | None = None


class Failed(msgspec.Struct, tag="failed"):
    """The engine could not be built (``starting``) or failed in a step; the core exits."""

    error: str
    starting: bool = False


ToCore = AddRequests | AbortRequests | Shutdown
FromCore = Ready | Outputs | Failed

encoder = msgspec.msgpack.Encoder()
to_core = msgspec.msgpack.Decoder(ToCore)
from_core = msgspec.msgpack.Decoder(FromCore)


def params_fields(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams' fields that travel as they are (everything but logits processors)."""
    return {name: getattr(params, name) for name in _PLAIN_FIELDS}


def params_from_fields(values: dict[str, Any]) -> SamplingParams:
    """The SamplingParams of ``params_fields``' output."""
    return SamplingParams(**values)
