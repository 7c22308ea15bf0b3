"""Prompt preparation: chat template rendering and tokenisation (no web framework needed).

Used by the server and by ``onecat generate --chat``.
"""

from __future__ import annotations

from typing import Any

from onecat.errors import OnecatError


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, str]],
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Render ``messages`` ([{role, content}]) with the tokenizer's chat template, ending with
    the assistant turn's opening (``add_generation_prompt``).

    Raises OnecatError when the tokenizer has no chat template or the template fails.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise OnecatError(
            "the model's tokenizer has no chat template (tokenizer_config.json / "
            "chat_template.jinja); use /v1/completions or `onecat generate` without --chat"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
    except Exception as exc:  # a jinja error in a user-provided template or kwargs
        raise OnecatError(f"the chat template failed to render these messages: {exc}") from exc
    return str(text)


def chat_token_ids(
    tokenizer: Any,
    messages: list[dict[str, str]],
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the rendered chat (the template already holds any special tokens)."""
    text = render_chat(tokenizer, messages, template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def text_token_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a plain-text prompt, with the tokenizer's own special tokens (e.g. BOS)."""
    return list(tokenizer.encode(prompt))

