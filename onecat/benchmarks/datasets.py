"""Benchmark prompts: synthetic ``random``, a JSONL file of prompts (``custom``) and
ShareGPT-format JSON (``sharegpt``), with the semantics of ``vllm bench serve``.

- random: input and output lengths drawn uniformly from
  ``[floor(L * (1 - r)), ceil(L * (1 + r))]`` (r = ``range_ratio``, seeded). With a
  tokenizer a prompt is that many random token ids (among those that decode to text on
  their own: no special tokens, no pieces of a UTF-8 character), decoded to text and
  re-encoded, truncated or padded and tried again (as vLLM does) so the server sees the
  intended token count; without one it is that many common English words (about one
  token each in the usual BPE vocabularies) and the server's usage gives the real count.
  ``prefix_len`` (vLLM's ``--random-prefix-len``): one random prefix of that many tokens,
  drawn once per run, before the random part of each prompt (a prompt is then
  ``prefix_len`` + its drawn length tokens). ``prefix_share`` (onecat's
  ``--random-prefix-share``, default 1: vLLM's behaviour) is the share of requests that carry
  it, spread evenly over the run (request ``i`` carries it when ``floor((i + 1) * share)``
  exceeds ``floor(i * share)``); the others get as many fresh random tokens in its place, so
  the share changes what a prefix cache can reuse, not the prompt lengths.
- custom: one JSON object per line; the prompt is the string in ``field``.
- sharegpt: a JSON list of ``{"conversations": [{"from": "human", "value": ...},
  {"from": "gpt", "value": ...}, ...]}``; the first human turn is the prompt and the
  length of the reply after it is the output length (unless fixed), with vLLM's filter
  (prompt and reply >= 4 tokens, prompt <= 1024, both <= 2048).

File datasets are shuffled with the seed; when a file has fewer prompts than asked for,
prompts are drawn again at random to make up the number.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from onecat.errors import OnecatError

DATASETS = ("random", "custom", "sharegpt")
HUMAN_ROLES = ("human", "user")
MAX_FIT_ROUNDS = 10
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048
CHARS_PER_TOKEN = 4  # English text without a tokenizer: OpenAI's rule of thumb

# Short, frequent English words: one token each in GPT-2, Llama and Qwen vocabularies.
WORDS = tuple(
    """the of and to in is was for on are as with his they at be this from have or by one
    had not but what all were when we there can an your which their said if do will each
    about how up out them then she many some so these would other into has more her two
    like him see time could no make than first been its who now people my made over did
    down only way find use may water long little very after words called just where most
    know get through back much go good new write our me man too any day same right look
    think also around another came come work three word must because does part even place
    well such here take why things help put years different away again off went old number
    great tell men say small every found still between name should home big give air line
    set own under read last never us left end along while might next sound below saw
    something thought both few those always looked show large often together asked house
    world going want school important until form food keep children feet land side without
    boy once animals life enough took sometimes four head above kind began almost live page
    got earth need far hand high year mother light parts country father let night following
    picture being study second eyes soon times story boys since white days ever paper hard
    near sentence better best across during today others however sure means knew""".split()
)


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark prompt: its text, its length in tokens (``prompt_len``; estimated
    without a tokenizer) and the number of tokens to ask for (``output_len``)."""

    prompt: str
    prompt_len: int
    output_len: int


def load_tokenizer(path: str) -> Any:
    """The Hugging Face tokenizer in ``path`` (a local directory or a hub id)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - any loading failure is the user's --tokenizer
        raise OnecatError(
            f"--tokenizer {path}: cannot load a tokenizer ({exc}); give the model's directory "
            "(tokenizer.json / tokenizer_config.json) or leave --tokenizer out"
        ) from None


def length_range(length: int, range_ratio: float, minimum: int = 0) -> tuple[int, int]:
    """vLLM's ``[floor(L * (1 - r)), ceil(L * (1 + r))]``, both ends at least ``minimum``."""
    low = max(math.floor(length * (1 - range_ratio)), minimum)
    high = max(math.ceil(length * (1 + range_ratio)), minimum)
    return low, high


def random_requests(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    tokenizer: Any | None = None,
    prefix_len: int = 0,
    prefix_share: float = 1.0,
) -> list[SampleRequest]:
    """``num_requests`` synthetic prompts (see the module docstring), reproducible by seed."""
    if not 0.0 <= range_ratio < 1.0:
        raise OnecatError(f"--random-range-ratio must be in [0, 1); got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise OnecatError(
            f"--random-input-len and --random-output-len must be >= 1; got {input_len}, {output_len}"
        )
    if prefix_len < 0:
        raise OnecatError(f"--random-prefix-len must be >= 0; got {prefix_len}")
    if not 0.0 <= prefix_share <= 1.0:
        raise OnecatError(f"--random-prefix-share must be in [0, 1]; got {prefix_share}")
    rng = np.random.default_rng(seed)
    num_special = int(tokenizer.num_special_tokens_to_add()) if tokenizer is not None else 0
    in_low, in_high = length_range(max(0, input_len - num_special), range_ratio, minimum=1)
    out_low, out_high = length_range(output_len, range_ratio, minimum=1)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    carries = prefix_carriers(num_requests, prefix_share) if prefix_len else [False] * num_requests
    if tokenizer is None:
        words = np.array(WORDS)
        prefix = words[rng.integers(0, len(words), size=prefix_len)].tolist() if prefix_len else []

        def text(n: int, shared: bool) -> str:
            head = prefix if shared or not prefix_len else words[rng.integers(0, len(words), size=prefix_len)].tolist()
            return " ".join(head + words[rng.integers(0, len(words), size=n)].tolist())

        return [
            SampleRequest(text(int(n), shared), prefix_len + int(n), int(m))
            for n, m, shared in zip(input_lens, output_lens, carries, strict=True)
        ]
    allowed = whole_text_tokens(tokenizer)
    prefix_ids = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len else []
    requests = []
    for n, m, shared in zip(input_lens, output_lens, carries, strict=True):
        fresh = not shared and prefix_len
        head = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if fresh else prefix_ids
        ids = head + allowed[rng.integers(0, len(allowed), size=n)].tolist()
        text, length = fit_to_length(tokenizer, ids, prefix_len + int(n), allowed, rng)
        requests.append(SampleRequest(text, length + num_special, int(m)))
    return requests


def prefix_carriers(num_requests: int, share: float) -> list[bool]:
    """Which requests carry the shared prefix, evenly spread: request ``i``
    when ``floor((i + 1) * share) > floor(i * share)`` (share 0.5: every second one, from the
    second; 1: all; 0: none)."""
    return [math.floor((i + 1) * share) > math.floor(i * share) for i in range(num_requests)]


def whole_text_tokens(tokenizer: Any) -> np.ndarray:
    """The ids that decode to text on their own: no special token, no piece of a UTF-8
    character (random prompts of those re-encode to their length far more often)."""
    special = set(tokenizer.all_special_ids)
    ids = [t for t in range(tokenizer.vocab_size) if t not in special]
    texts = tokenizer.batch_decode([[t] for t in ids])
    allowed = np.array([t for t, text in zip(ids, texts, strict=True) if text and "\ufffd" not in text])
    if len(allowed) == 0:
        raise OnecatError("the tokenizer has no token that decodes to text; give another --tokenizer")
    return allowed


def fit_to_length(
    tokenizer: Any, ids: list[int], target: int, allowed: np.ndarray, rng: np.random.Generator
) -> tuple[str, int]:
    """Text whose encoding is ``target`` tokens long where possible: decode ``ids``,
    re-encode, truncate or pad with random allowed ids, repeat (decoding can merge or split
    tokens). Returns the text and the length of its encoding (without special tokens)."""
    for round_ in range(MAX_FIT_ROUNDS + 1):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target or round_ == MAX_FIT_ROUNDS:
            return text, len(ids)
        if len(ids) > target:
            ids = ids[:target]
        else:
            ids = ids + allowed[rng.integers(0, len(allowed), size=target - len(ids))].tolist()
    raise AssertionError("unreachable")


def _token_count(text: str, tokenizer: Any | None) -> int:
    """Tokens of ``text`` (an estimate of about four characters a token without a tokenizer)."""
    if tokenizer is None:
        return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))
    return len(tokenizer.encode(text, add_special_tokens=False))


def _take(requests: list[SampleRequest], num_requests: int, rng: np.random.Generator) -> list[SampleRequest]:
    """The first ``num_requests`` requests, topped up by random draws when there are fewer."""
    if len(requests) >= num_requests:
        return requests[:num_requests]
    extra = rng.integers(0, len(requests), size=num_requests - len(requests))
    return requests + [requests[i] for i in extra]


def custom_requests(
    path: str | Path,
    num_requests: int,
    output_len: int,
    field: str = "prompt",
    seed: int = 0,
    tokenizer: Any | None = None,
) -> list[SampleRequest]:
    """Prompts from a JSONL file: the string ``field`` of each line's object."""
    path = Path(path)
    if output_len < 1:
        raise OnecatError(f"--custom-output-len must be >= 1; got {output_len}")
    prompts = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise OnecatError(f"{path}:{number}: not valid JSON ({exc.msg}); expected one JSON object per line") from None
        if not isinstance(item, dict) or not isinstance(item.get(field), str):
            raise OnecatError(
                f"{path}:{number}: no string field {field!r} in {_short(line)}; "
                "choose the field holding the prompt with --prompt-field"
            )
        prompts.append(item[field])
    if not prompts:
        raise OnecatError(f"{path}: no prompts (the file is empty)")
    rng = np.random.default_rng(seed)
    rng.shuffle(prompts)
    requests = [SampleRequest(p, _token_count(p, tokenizer), output_len) for p in prompts]
    return _take(requests, num_requests, rng)


def sharegpt_requests(
    path: str | Path,
    num_requests: int,
    output_len: int | None = None,
    seed: int = 0,
    tokenizer: Any | None = None,
) -> list[SampleRequest]:
    """Prompts from a ShareGPT-format JSON file (see the module docstring); ``output_len``
    fixes the output length instead of the reply's length."""
    path = Path(path)
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise OnecatError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); expected a ShareGPT list") from None
    if not isinstance(data, list):
        raise OnecatError(f"{path}: expected a JSON list of {{\"conversations\": [...]}} entries, got {type(data).__name__}")
    turns = [pair for entry in data if (pair := _first_exchange(entry)) is not None]
    if not turns:
        raise OnecatError(
            f"{path}: no entry has a \"conversations\" list with a human turn followed by a "
            "reply (fields \"from\" and \"value\")"
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(turns))
    requests = []
    for i in order:
        if len(requests) == num_requests:
            break
        prompt, reply = turns[i]
        prompt_len = _token_count(prompt, tokenizer)
        reply_len = output_len if output_len is not None else _token_count(reply, tokenizer)
        too_short = prompt_len < SHAREGPT_MIN_LEN or (output_len is None and reply_len < SHAREGPT_MIN_LEN)
        if too_short or prompt_len > SHAREGPT_MAX_PROMPT or prompt_len + reply_len > SHAREGPT_MAX_TOTAL:
            continue
        requests.append(SampleRequest(prompt, prompt_len, reply_len))
    if not requests:
        raise OnecatError(
            f"{path}: every conversation was filtered out (prompt and reply must be >= "
            f"{SHAREGPT_MIN_LEN} tokens, the prompt <= {SHAREGPT_MAX_PROMPT}, both <= {SHAREGPT_MAX_TOTAL})"
        )
    return _take(requests, num_requests, rng)


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    """The first human turn and the reply after it; turns without roles count by position."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    turns = [t for t in turns if isinstance(t, dict) and isinstance(t.get("value"), str)]
    for a, b in zip(turns, turns[1:], strict=False):
        roles = (a.get("from"), b.get("from"))
        if roles == (None, None) or (roles[0] in HUMAN_ROLES and roles[1] not in HUMAN_ROLES):
            return a["value"], b["value"]
    return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise OnecatError(f"--dataset-path {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OnecatError(f"--dataset-path {path}: cannot read it as UTF-8 text ({exc})") from None


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def dataset_name_for(dataset_name: str | None, dataset_path: str | None) -> str:
    """The dataset's name: given, else ``random`` without a file, else from the file's
    suffix (``.jsonl``: custom, ``.json``: sharegpt)."""
    if dataset_name:
        return dataset_name
    if not dataset_path:
        return "random"
    by_suffix = {".jsonl": "custom", ".json": "sharegpt"}
    name = by_suffix.get(Path(dataset_path).suffix.lower())
    if name is None:
        raise OnecatError(f"--dataset-path {dataset_path}: give --dataset-name custom or sharegpt")
    return name


def sample_requests(
    dataset_name: str | None,
    num_requests: int,
    *,
    dataset_path: str | None = None,
    prompt_field: str = "prompt",
    random_input_len: int = 1024,
    random_output_len: int = 128,
    random_range_ratio: float = 0.0,
    random_prefix_len: int = 0,
    random_prefix_share: float = 1.0,
    custom_output_len: int = 256,
    sharegpt_output_len: int | None = None,
    seed: int = 0,
    tokenizer: Any | None = None,
) -> list[SampleRequest]:
    """The requests of one benchmark run, by dataset name (see :func:`dataset_name_for`)."""
    if num_requests < 1:
        raise OnecatError(f"--num-prompts must be >= 1; got {num_requests}")
    dataset_name = dataset_name_for(dataset_name, dataset_path)
    if dataset_name == "random":
        return random_requests(num_requests, random_input_len, random_output_len,
                               random_range_ratio, seed, tokenizer, random_prefix_len, random_prefix_share)
    if dataset_name not in DATASETS:
        raise OnecatError(f"--dataset-name {dataset_name!r}: choose one of {', '.join(DATASETS)}")
    if not dataset_path:
        raise OnecatError(f"--dataset-name {dataset_name} needs --dataset-path FILE")
    if dataset_name == "custom":
        return custom_requests(dataset_path, num_requests, custom_output_len, prompt_field, seed, tokenizer)
    return sharegpt_requests(dataset_path, num_requests, sharegpt_output_len, seed, tokenizer)

