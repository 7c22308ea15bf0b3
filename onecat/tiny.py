"""Tiny random checkpoints of the supported model families, built locally with no download.

They have the real checkpoints' structure (Qwen3.5's multimodal wrapper keys
``model.language_model.*``, hybrid ``layer_types``, gated q_proj, fused 3-D MoE experts,
``mtp.*`` tensors, untied lm_head) and a small byte-level BPE tokenizer trained on the
Python standard library's pydoc topics, with a ChatML chat template. Used by ``make demo``,
the tests and the benchmarks' smoke runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from onecat.quantize.calibration import pydoc_text

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3", "llama")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3.5's chat-template structure (Qwen/Qwen3.5-*'s chat_template.jinja, shortened): tools
# listed in the system turn with its call-format instructions, assistant tool calls in its XML
# format, tool results as <tool_response> in a user turn, and the generation prompt opening a
# think block (an empty, closed one with enable_thinking=false). The Qwen3.5 families use it.
QWEN3_5_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:"
    "\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1"
    "\\n</parameter>\\n</function>\\n</tool_call>' }}"
    "{%- if messages[0].role == 'system' %}{{- '\\n\\n' + messages[0].content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{{- ('\\n\\n' if (loop.first and message.content) else ('' if loop.first else '\\n'))"
    " + '<tool_call>\\n<function=' + call.name + '>\\n' }}"
    "{%- if call.arguments is mapping %}{%- for name, value in call.arguments | items %}"
    "{{- '<parameter=' + name + '>\\n' + (value | tojson if value is mapping or (value is sequence"
    " and value is not string) else value | string) + '\\n</parameter>\\n' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)


def build_tokenizer(out_dir: Path, vocab_size: int = 512, text: str | None = None) -> None:
    """Train a byte-level BPE tokenizer on ``text`` (default: the pydoc text) and save it
    (with a chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = pydoc_text() if text is None else text
    tok.train_from_iterator((text[i : i + 4096] for i in range(0, len(text), 4096)), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def _text_kwargs(family: str, vocab_size: int, num_layers: int) -> dict:
    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if family in ("qwen3_5", "qwen3_5_moe"):
        common.update(
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                for i in range(num_layers)
            ],
        )
    if family == "qwen3_5":
        common.update(intermediate_size=256)
    elif family == "qwen3_5_moe":
        common.update(
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
        )
    else:
        common.update(intermediate_size=256)
    return common


def _build_model(
    family: str, vocab_size: int, num_layers: int, eos_id: int, overrides: dict | None
):
    import transformers as tf

    kwargs = _text_kwargs(family, vocab_size, num_layers)
    kwargs.update(overrides or {})
    if family == "qwen3_5":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128)
        config = tf.Qwen3_5Config(text_config=kwargs, vision_config=vision)
        model = tf.Qwen3_5ForConditionalGeneration(config)
    elif family == "qwen3_5_moe":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128)
        config = tf.Qwen3_5MoeConfig(text_config=kwargs, vision_config=vision)
        model = tf.Qwen3_5MoeForConditionalGeneration(config)
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**kwargs))
    elif family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**kwargs))
    else:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    model.config.eos_token_id = eos_id
    text_cfg = getattr(model.config, "text_config", None)
    if text_cfg is not None:
        text_cfg.eos_token_id = eos_id
    return model


def _perturb_norms(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give norm weights non-trivial values so that scale folding is actually exercised."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                noise = torch.randn(param.shape, generator=generator) * 0.1
                param.add_(noise.to(param.dtype))


class SeparatedRouting:
    """Expert routing whose top-k choice has a guaranteed margin, for random-weight MoE models.

    Tests compare engines (fp32 vs bf16, eager vs CUDA graphs, TP 1 vs TP 2) on random
    weights. With a random router the k-th and (k+1)-th expert scores are often within
    rounding of each other, the engines then pick different experts and the outputs part.
    Scaling a linear router up does not help (the rounding scales with it), and no linear
    router separates its top-k for *every* hidden state ``h``: between ``h`` and ``-h`` the
    top-k set changes, and where it changes two scores tie. So the separation is built into
    the residual stream instead, with the real key layout and only the values changed:

    - channels ``0 .. E-1`` of the residual stream are *routing channels*. Each token's
      embedding holds ``k`` decreasing positive amplitudes in ``k`` routing channels chosen
      per token (seeded) and exactly 0 in the other routing channels;
    - every module that writes the residual stream (attention ``o_proj``, GDN ``out_proj``,
      the routed and shared experts' ``down_proj``) has zero rows for the routing channels
      (:meth:`clear_routing_rows`), so the residual keeps the embedding's routing values
      exactly, through every layer and in any precision;
    - layer ``l``'s router (:meth:`router`) reads expert ``e``'s score from routing channel
      ``perm_l(e)`` alone (one non-zero per row, a seeded permutation per layer).

    After the post-attention RMSNorm (its routing-channel weights kept ``1 + w > 0``), the
    k chosen experts score ``gain * a_j * (1 + w_c) / rms(x) > 0`` and every other expert
    scores exactly 0 (a sum of exact zeros), whatever the rest of the hidden state: the
    top-k set is the token's code at every layer, for any context, dtype or summation
    order. The routing weights within it still depend on the context (through ``rms(x)``).
    Which experts a token reaches differs per token and per layer (:meth:`experts`).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, seed: int = 0) -> None:
        if not 0 < top_k < num_experts <= hidden_size // 2:
            raise ValueError(
                f"separated routing needs 0 < top_k ({top_k}) < num_experts ({num_experts}) "
                f"<= hidden_size / 2 ({hidden_size // 2}): the routing channels are part of "
                "the hidden state"
            )
        self.num_experts, self.top_k, self.hidden_size, self.seed = num_experts, top_k, hidden_size, seed
        self.relative = 1.0 - torch.arange(top_k, dtype=torch.float64) / (2 * top_k)
        """Amplitude of a token's j-th routing channel relative to its first (1 .. >1/2)."""

    @property
    def channels(self) -> slice:
        """The routing channels of the hidden state (also the rows writers must leave zero)."""
        return slice(0, self.num_experts)

    def token_channels(self, vocab_size: int) -> torch.Tensor:
        """``[vocab, k]`` int64: each token's routing channels, largest amplitude first."""
        gen = torch.Generator().manual_seed(self.seed)
        return torch.rand(vocab_size, self.num_experts, generator=gen).argsort(-1)[:, : self.top_k]

    def permutation(self, layer: int) -> torch.Tensor:
        """``[E]`` int64: layer ``layer``'s router reads expert ``e`` from channel ``perm[e]``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + layer + 1)
        return torch.randperm(self.num_experts, generator=gen)

    def embedding(self, base: torch.Tensor) -> torch.Tensor:
        """``base`` ``[vocab, H]`` with its routing channels set (a new float32 tensor).

        The amplitudes give the routing channels about as much energy as the other
        channels of a row have in ``base``."""
        vocab, hidden = base.shape
        if hidden != self.hidden_size:
            raise ValueError(f"embedding width {hidden} != hidden_size {self.hidden_size}")
        out = base.float().clone()
        rest = out[:, self.num_experts :]
        row_energy = rest.pow(2).sum(-1).mean().item()
        amplitude = (row_energy / self.relative.pow(2).sum().item()) ** 0.5
        out[:, self.channels] = 0
        values = (amplitude * self.relative).float().to(out.device).expand(vocab, self.top_k)
        out.scatter_(1, self.token_channels(vocab).to(out.device), values)
        return out

    def router(self, layer: int, gain: float | None = None) -> torch.Tensor:
        """``[E, H]`` float32 router weight of layer ``layer``: one non-zero, ``gain``, per row.

        The default gain scores a token's first expert about 2 when the routing channels hold
        half of the hidden state's energy (its k-th about 1): the unchosen experts (score 0)
        keep a good share of the softmax, so the top-k renormalisation matters, and the
        chosen experts' weights differ."""
        if gain is None:
            first = (self.hidden_size / (2 * self.relative.pow(2).sum().item())) ** 0.5
            gain = 2.0 / first
        weight = torch.zeros(self.num_experts, self.hidden_size)
        weight[torch.arange(self.num_experts), self.permutation(layer)] = gain
        return weight

    def experts(self, layer: int, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[..., k]`` int64: the experts (as a set; in channel order) that layer ``layer``
        routes each of ``token_ids`` to."""
        channel_to_expert = self.permutation(layer).argsort()
        return channel_to_expert[self.token_channels(vocab_size)[token_ids]]

    def clear_routing_rows(self, weight: torch.Tensor) -> None:
        """Zero, in place, the routing-channel rows of a residual writer's weight
        ``[..., H, K]`` (``o_proj``, ``out_proj``, ``down_proj``; stacked experts too)."""
        if weight.shape[-2] != self.hidden_size:
            raise ValueError(f"a residual writer has {self.hidden_size} rows, got {tuple(weight.shape)}")
        weight[..., self.channels, :] = 0


def _separate_routing(model: torch.nn.Module, seed: int) -> None:
    """Give a transformers Qwen3.5 MoE model :class:`SeparatedRouting` (embedding routing
    channels, zero routing rows in every residual writer, per-layer routers)."""
    text = model.model.language_model
    cfg = model.config.text_config
    routing = SeparatedRouting(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, seed)
    with torch.no_grad():
        embed = text.embed_tokens.weight
        embed.copy_(routing.embedding(embed))
        for index, layer in enumerate(text.layers):
            mixer = layer.self_attn.o_proj if hasattr(layer, "self_attn") else layer.linear_attn.out_proj
            routing.clear_routing_rows(mixer.weight)
            routing.clear_routing_rows(layer.mlp.experts.down_proj)
            routing.clear_routing_rows(layer.mlp.shared_expert.down_proj.weight)
            norm = layer.post_attention_layernorm.weight  # (1 + w) form: keep 1 + w >= 0.5
            norm[routing.channels] = norm[routing.channels].clamp(min=-0.5)
            layer.mlp.gate.weight.copy_(routing.router(index))


def _add_mtp_tensors(out_dir: Path, hidden: int, generator: torch.Generator) -> None:
    """Real Qwen3.5 checkpoints carry a multi-token-prediction head (``mtp.*``) that
    transformers ignores on load; add a small one so tools must copy it through."""
    tensors = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) * 0.02,
        "mtp.norm.weight": torch.zeros(hidden),
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden),
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden),
    }
    write_mtp_tensors(out_dir, tensors)


def write_mtp_tensors(out_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Save ``mtp.*`` ``tensors`` (as bf16) into their own shard of the checkpoint at
    ``out_dir`` and list them in its index (created from a single ``model.safetensors``)."""
    shard = out_dir / "model-mtp.safetensors"
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path = out_dir / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        single = out_dir / "model.safetensors"
        names = list(load_file(single).keys())
        index = {"metadata": {}, "weight_map": {n: single.name for n in names}}
    for name in tensors:
        index["weight_map"][name] = shard.name
    index_path.write_text(json.dumps(index, indent=2))


def _fuse_experts(out_dir: Path) -> None:
    """Rewrite per-expert 2-D weights as the fused 3-D tensors the official 35B-A3B ships:
    ``experts.gate_up_proj`` [E, 2*I, H] (gate rows, then up rows) and ``experts.down_proj``
    [E, H, I]."""
    import re

    index_path = out_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    pattern = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(out_dir / shard)
        experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        kept = {}
        for name, t in tensors.items():
            m = pattern.match(name)
            if m:
                experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
            else:
                kept[name] = t
        if not experts:
            continue
        for prefix, per_expert in experts.items():
            ids = sorted(per_expert)
            if ids != list(range(len(ids))) or any(len(per_expert[e]) != 3 for e in ids):
                raise RuntimeError(f"experts of {prefix} are split across shards; use a larger shard size")
            kept[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([per_expert[e]["gate_proj"], per_expert[e]["up_proj"]]) for e in ids]
            )
            kept[f"{prefix}.down_proj"] = torch.stack([per_expert[e]["down_proj"] for e in ids])
        for name in list(index["weight_map"]):
            if index["weight_map"][name] == shard and name not in kept:
                del index["weight_map"][name]
        for name in kept:
            index["weight_map"][name] = shard
        save_file({k: v.contiguous() for k, v in kept.items()}, out_dir / shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=2))


def build_tiny_model(
    family: str,
    out_dir: str | Path,
    *,
    num_layers: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: str = "1MB",
    fused_experts: bool = True,
    config_overrides: dict | None = None,
) -> Path:
    """Write a tiny random checkpoint of ``family`` (with tokenizer) to ``out_dir``.

    The checkpoint is sharded (several safetensors files and an index) like real ones; MoE
    experts are stored fused (3-D) like the official Qwen3.5-35B-A3B unless ``fused_experts``
    is False. MoE models route with :class:`SeparatedRouting` (a top-k choice with a
    guaranteed margin). ``config_overrides`` replaces entries of the (text) config, e.g.
    wider heads. Returns the directory.
    """
    from transformers import AutoTokenizer

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    if family.startswith("qwen3_5"):  # Qwen3.5's own template structure (tools, thinking)
        (out / "chat_template.jinja").write_text(QWEN3_5_CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = _build_model(
        family, len(tokenizer), num_layers, tokenizer.eos_token_id, config_overrides
    )
    _perturb_norms(model, generator)
    if family == "qwen3_5_moe":
        _separate_routing(model, seed)
    model = model.to(dtype)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    if family.startswith("qwen3_5"):
        if family == "qwen3_5_moe" and fused_experts:
            _fuse_experts(out)
        _add_mtp_tensors(out, model.config.text_config.hidden_size, generator)
    return out


if __name__ == "__main__":
    import sys

    for fam in FAMILIES:
        path = build_tiny_model(fam, Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny") / fam)
        print(path, sorted(p.name for p in path.iterdir()))
