"""The model facts the runtime needs, read from a checkpoint's config.json.

Qwen3.5's released checkpoints are multimodal wrappers whose language model settings sit
in ``text_config``; text-only configs keep them at the top level. Both are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from onecat.errors import OnecatError

VOCAB_ROW_ALIGN = 32
"""A vocab-parallel ``lm_head`` slice is a multiple of this many rows (the Volta layout's tile)."""
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


@dataclass
class ModelConfig:
    """Qwen3.5 (dense or MoE) text model hyper-parameters."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    intermediate_size: int = 0  # dense MLP
    num_experts: int = 0  # 0: dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    vocab_partitions: int = 1
    """Tensor parallelism: how many ranks split ``lm_head``'s rows (the vocabulary) between
    them (``onecat.runtime.sharding.shard_config``); 1: this model computes every logit."""

    @property
    def lm_head_rows(self) -> int:
        """Rows of ``lm_head`` this model holds: the vocabulary, or one rank's equal share of
        it (:func:`vocab_rows_per_partition`)."""
        return vocab_rows_per_partition(self.vocab_size, self.vocab_partitions)

    @property
    def is_moe(self) -> bool:
        """True for the mixture-of-experts model."""
        return self.num_experts > 0

    @property
    def num_full_attention_layers(self) -> int:
        """Layers with a KV cache."""
        return self.layer_types.count("full_attention")

    @property
    def num_linear_attention_layers(self) -> int:
        """Gated DeltaNet layers (with a conv and a recurrent state per sequence)."""
        return self.layer_types.count("linear_attention")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse a config.json dict (wrapper or text-only). Raises OnecatError when it is not
        a Qwen3.5 model or a field is missing."""
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise OnecatError(
                f"{source}: model_type {model_type!r} is not supported by onecat's runtime "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        text = dict(raw.get("text_config") or raw)
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        num_layers = _field(text, "num_hidden_layers", source)
        layer_types = text.get("layer_types") or [
            "full_attention" if (i + 1) % int(text.get("full_attention_interval", 4)) == 0
            else "linear_attention"
            for i in range(num_layers)
        ]
        if len(layer_types) != num_layers or set(layer_types) - {"full_attention", "linear_attention"}:
            raise OnecatError(
                f"{source}: layer_types must list 'full_attention' or 'linear_attention' for each "
                f"of the {num_layers} layers"
            )
        hidden = _field(text, "hidden_size", source)
        heads = _field(text, "num_attention_heads", source)
        return cls(
            model_type=model_type,
            vocab_size=_field(text, "vocab_size", source),
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            layer_types=list(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=_field(text, "num_key_value_heads", source),
            head_dim=int(text.get("head_dim") or hidden // heads),
            linear_num_key_heads=_field(text, "linear_num_key_heads", source),
            linear_num_value_heads=_field(text, "linear_num_value_heads", source),
            linear_key_head_dim=_field(text, "linear_key_head_dim", source),
            linear_value_head_dim=_field(text, "linear_value_head_dim", source),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
            ),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(
                text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
            ),
            attention_bias=bool(text.get("attention_bias", False)),
            intermediate_size=int(text.get("intermediate_size") or 0),
            num_experts=int(text.get("num_experts") or 0),
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            eos_token_ids=eos_ids,
        )


def vocab_rows_per_partition(vocab_size: int, partitions: int) -> int:
    """Rows of the vocabulary each of ``partitions`` ranks holds: all of it for one; else
    ``vocab_size / partitions`` rounded up to a multiple of 32 (a packed ``lm_head`` slice
    must be whole 32-row tiles), so slices are equal and the last ranks' end in padding
    rows, whose logits are cut off after the gather. Rank ``r`` holds rows ``r * rows ..``."""
    if partitions == 1:
        return vocab_size
    return -(-vocab_size // (partitions * VOCAB_ROW_ALIGN)) * VOCAB_ROW_ALIGN


def _field(text: dict[str, Any], name: str, source: str) -> int:
    if name not in text:
        raise OnecatError(f"{source}: field {name!r} is missing from the (text_)config")
    return int(text[name])
