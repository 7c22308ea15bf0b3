"""The checks a request passes before it enters an engine.

One function, called by ``LLMEngine.add_request`` and by the API process before it sends a
request to an engine-core process (``onecat.runtime.core``), so that a bad request is a 400
before anything is sent and both sides refuse exactly the same requests.
"""

from __future__ import annotations

from onecat.runtime.errors import RequestError
from onecat.runtime.sampling_params import SamplingParams


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """Raise RequestError (naming the field) when the request cannot be served as asked:
    settings out of range, an empty prompt, token ids outside the vocabulary, or a prompt
    plus ``max_tokens`` longer than ``max_model_len``."""
    params.validate()
    if not prompt_token_ids:
        raise RequestError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise RequestError(f"prompt token ids must be in 0..{vocab_size - 1}", param="prompt")
    if any(t >= vocab_size for t in params.logit_bias):
        raise RequestError(f"logit_bias token ids must be in 0..{vocab_size - 1}", param="logit_bias")
    if len(prompt_token_ids) >= max_model_len:
        raise RequestError(
            f"the prompt has {len(prompt_token_ids)} tokens; this model serves at most "
            f"{max_model_len} tokens (prompt + completion)"
        )
    if len(prompt_token_ids) + params.max_tokens > max_model_len:
        raise RequestError(
            f"max_tokens {params.max_tokens} is too large: the prompt has "
            f"{len(prompt_token_ids)} tokens and the limit is {max_model_len}, so at "
            f"most {max_model_len - len(prompt_token_ids)} can be generated",
            param="max_tokens",
        )
