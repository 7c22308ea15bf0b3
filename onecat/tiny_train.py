"""Trained tiny Qwen3.5 checkpoints: the test fixtures whose greedy tokens have real margins.

:mod:`onecat.tiny` builds random checkpoints; their next-token distributions are nearly flat,
so engines that round differently may pick different greedy tokens. This module *trains* tiny
Qwen3.5 dense (``qwen3_5``) and MoE (``qwen3_5_moe``) models instead, on CPU in a few
minutes, deterministically:

- architecture: transformers' own ``Qwen3_5ForConditionalGeneration`` /
  ``Qwen3_5MoeForConditionalGeneration`` (Gated DeltaNet + gated attention, ``(1+w)`` norms,
  MoE with a shared expert and a trained softmax top-k router), the shapes of
  :func:`onecat.tiny._text_kwargs` with linear-attention head dims of 128 (what vLLM's CPU
  kernel accepts), saved with the real key layout (``model.language_model.*``, fused 3-D
  experts, untied ``lm_head``);
- multi-token prediction: transformers ignores ``mtp.*``, so :class:`MtpHead` is this
  module's own torch module over the real key layout (``mtp.pre_fc_norm_embedding``,
  ``mtp.pre_fc_norm_hidden``, ``mtp.fc`` over ``[embedding ; hidden]``, one full-attention
  decoder layer ``mtp.layers.0.*`` of transformers' class, ``mtp.norm``; embedding and
  ``lm_head`` shared with the model), trained with its own next-next-token loss: at position
  ``t`` it takes the model's final (normed) hidden state and the embedding of token ``t+1``
  and predicts token ``t+2``;
- tokenizer: byte-level BPE of :data:`VOCAB_SIZE` tokens trained on the training text, plus
  the chat template's special tokens (:func:`onecat.tiny.build_tokenizer`);
- text: the running Python's pydoc topics, sorted by key; every :data:`HELDOUT_EVERY`-th
  topic is held out (:func:`heldout_text`, for perplexity and AWQ quality), the rest is
  trained on, raw and as one chat exchange per topic (``Explain: TITLE`` answered by the
  topic's opening), so a chat question about a topic is answered in recognisable text;
- determinism: seeded initialisation and batches, one CPU thread, deterministic algorithms.

The checkpoints are committed under ``onecat/fixtures/`` (package data, a few MB each, with the command
that made them, the torch / Python versions and the held-out perplexity in
``training.json``): training takes minutes, and a CPU with other vector units or another
Python (its pydoc text) would train slightly different weights, while the tests need the
same weights everywhere. Run: ``python -m onecat.tiny_train --out onecat/fixtures``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from onecat.formats.staging import check_replaceable
from onecat.tiny import _build_model, _fuse_experts, build_tokenizer, write_mtp_tensors

FIXTURES = Path(__file__).resolve().parent / "fixtures"
"""Where the committed trained checkpoints live (``FIXTURES / "trained-qwen3_5"``, ...)."""
VOCAB_SIZE = 2048
HELDOUT_EVERY = 8
"""Topics ``keys[i]`` with ``i % HELDOUT_EVERY == HELDOUT_EVERY - 1`` are held out."""
ANSWER_CHARS = 400
"""A chat answer is the topic's opening paragraphs, cut at a paragraph end near this length."""
CONFIG_OVERRIDES = {"linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_value_heads": 2}
"""Linear-attention head dims of 128 (vLLM's CPU Gated DeltaNet kernel needs them), two key
and two value heads (a tensor-parallel split of 2 still works; four value heads of 128 would
double the training time)."""


@dataclass(frozen=True)
class TrainSpec:
    """How one tiny model is trained (recorded in its ``training.json``)."""

    family: str
    steps: int = 400
    batch: int = 8
    seqlen: int = 128
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    mtp_weight: float = 0.3
    aux_weight: float = 0.01
    seed: int = 0
    threads: int = 1


def fixture_dir(family: str) -> Path:
    """The committed trained checkpoint of ``family`` (``qwen3_5`` or ``qwen3_5_moe``)."""
    return FIXTURES / f"trained-{family}"


def _topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(key, topics[key]) for key in sorted(topics)]


def _is_heldout(index: int) -> bool:
    return index % HELDOUT_EVERY == HELDOUT_EVERY - 1


def heldout_text() -> str:
    """The held-out pydoc topics (never trained on), joined by blank lines."""
    return "\n\n".join(text for i, (_, text) in enumerate(_topics()) if _is_heldout(i))


def training_topics() -> list[tuple[str, str]]:
    """The ``(key, text)`` pydoc topics the models are trained on."""
    return [topic for i, topic in enumerate(_topics()) if not _is_heldout(i)]


def chat_exchange(text: str) -> tuple[str, str]:
    """A topic's chat exchange: ``("Explain: TITLE", opening paragraphs)``."""
    lines = text.split("\n")
    title = lines[0].strip()
    body = "\n".join(lines[2:]).strip()
    answer = ""
    for paragraph in body.split("\n\n"):
        if answer and len(answer) + len(paragraph) > ANSWER_CHARS:
            break
        answer = f"{answer}\n\n{paragraph}" if answer else paragraph
    return f"Explain: {title}", answer[: 2 * ANSWER_CHARS]


def training_text(tokenizer) -> str:
    """The training stream: every training topic as a chat exchange, then the topics raw."""
    chats = []
    for _, text in training_topics():
        question, answer = chat_exchange(text)
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        chats.append(tokenizer.apply_chat_template(messages, tokenize=False))
    raw = [text for _, text in training_topics()]
    return "\n\n".join(chats + raw)


class MtpHead(nn.Module):
    """Qwen3.5's multi-token-prediction head over the real ``mtp.*`` key layout.

    ``forward(hidden, next_embeds, position_embeddings)``: ``hidden`` is the model's final
    normed hidden state at positions ``t``, ``next_embeds`` the embeddings of tokens ``t+1``;
    returns the MTP hidden state (after ``mtp.norm``), which the shared ``lm_head`` turns into
    logits for tokens ``t+2``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        text_model = model.model.language_model
        cfg = model.config.text_config
        norm_cls = type(text_model.norm)
        layer_cls = type(text_model.layers[0])
        full = cfg.layer_types.index("full_attention")
        hidden = cfg.hidden_size
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([layer_cls(cfg, full)])
        self.norm = norm_cls(hidden, eps=cfg.rms_norm_eps)
        nn.init.normal_(self.fc.weight, std=cfg.initializer_range)
        for name, param in self.layers.named_parameters():
            if param.dim() >= 2:
                nn.init.normal_(param, std=cfg.initializer_range)
            elif name.endswith("norm.weight"):
                nn.init.zeros_(param)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, position_embeddings) -> torch.Tensor:
        """MTP hidden states ``[B, T, H]`` (see the class docstring)."""
        x = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1)
        x = self.fc(x)
        for layer in self.layers:
            x = layer(x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)


def _lr(step: int, spec: TrainSpec) -> float:
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _load_balancing(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-style auxiliary loss: ``E * sum_e (share of top-k picks of e) * (mean prob of e)``."""
    logits = torch.cat(router_logits)
    probs = logits.softmax(-1)
    picks = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, -1).indices, 1.0)
    return num_experts * (picks.mean(0) / top_k * probs.mean(0)).sum()


def train_model(spec: TrainSpec, out_dir: str | Path, *, log=print) -> dict:
    """Train ``spec.family`` and write the checkpoint (bf16, real key layout, ``mtp.*``,
    tokenizer, ``training.json``) to ``out_dir``, staged in a sibling and renamed at the end.
    Returns the training record."""
    from transformers import AutoTokenizer

    out = Path(out_dir)
    staging = out.with_name(out.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    torch.set_num_threads(spec.threads)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()

    topics_text = "\n\n".join(text for _, text in training_topics())
    build_tokenizer(staging, vocab_size=VOCAB_SIZE, text=topics_text)
    tokenizer = AutoTokenizer.from_pretrained(staging)
    ids = torch.tensor(tokenizer(training_text(tokenizer), add_special_tokens=False)["input_ids"])

    torch.manual_seed(spec.seed)
    model = _build_model(spec.family, len(tokenizer), 4, tokenizer.eos_token_id, CONFIG_OVERRIDES)
    model.config.text_config._attn_implementation = "sdpa"  # causal without an explicit mask
    text_model, lm_head = model.model.language_model, model.lm_head
    mtp = MtpHead(model)
    cfg = model.config.text_config
    moe = spec.family == "qwen3_5_moe"
    router_logits: list[torch.Tensor] = []
    if moe:
        for layer in text_model.layers:
            layer.mlp.gate.register_forward_hook(lambda _m, _i, o: router_logits.append(o[0]))
    params = [p for n, p in model.named_parameters() if not n.startswith("model.visual")]
    params += list(mtp.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr, betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(spec.seed)
    window = spec.seqlen + 2
    model.train()
    mtp.train()
    history = []
    for step in range(spec.steps):
        starts = torch.randint(0, ids.numel() - window, (spec.batch,), generator=gen)
        batch = torch.stack([ids[s : s + window] for s in starts])
        inputs = batch[:, : spec.seqlen]
        router_logits.clear()
        hidden = text_model(input_ids=inputs).last_hidden_state  # after the final norm
        logits = lm_head(hidden)
        loss_main = nn.functional.cross_entropy(
            logits.flatten(0, 1), batch[:, 1 : spec.seqlen + 1].flatten()
        )
        # MTP at position t: hidden[t] and embedding of token t+1 -> token t+2.
        positions = torch.arange(spec.seqlen).view(1, 1, -1).expand(3, spec.batch, -1)
        rope = text_model.rotary_emb(hidden, positions)
        next_embeds = text_model.embed_tokens(batch[:, 1 : spec.seqlen + 1])
        mtp_logits = lm_head(mtp(hidden, next_embeds, rope))
        loss_mtp = nn.functional.cross_entropy(
            mtp_logits.flatten(0, 1), batch[:, 2 : spec.seqlen + 2].flatten()
        )
        loss = loss_main + spec.mtp_weight * loss_mtp
        if moe:
            loss = loss + spec.aux_weight * _load_balancing(
                router_logits, cfg.num_experts, cfg.num_experts_per_tok
            )
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, spec)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % 50 == 0 or step == spec.steps - 1:
            history.append({"step": step, "loss": round(loss_main.item(), 4),
                            "mtp_loss": round(loss_mtp.item(), 4)})
            log(f"{spec.family} step {step}: loss {loss_main.item():.3f} "
                f"mtp {loss_mtp.item():.3f} ({time.perf_counter() - started:.0f} s)")

    model.eval()
    model = model.to(torch.bfloat16)
    model.save_pretrained(staging, max_shard_size="2MB")
    if moe:
        _fuse_experts(staging)
    write_mtp_tensors(staging, {f"mtp.{k}": v for k, v in mtp.state_dict().items()})
    record = {
        "family": spec.family,
        "command": f"python -m onecat.tiny_train --family {spec.family} --steps {spec.steps}",
        "spec": asdict(spec),
        "vocab_size": len(tokenizer),
        "training_tokens": ids.numel(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "train_seconds": round(time.perf_counter() - started, 1),
        "history": history,
    }
    (staging / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    # Replace a previous checkpoint only where every file of it is rewritten: nothing else is lost.
    check_replaceable(out, written=lambda name: (staging / name).is_file())
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return record


def heldout_perplexity(model_dir: Path, tokens: int = 4096, ctx: int = 256) -> float:
    """Perplexity of the checkpoint at ``model_dir`` on :func:`heldout_text` (onecat's eval)."""
    import tempfile

    from onecat.quantize.evaluate import evaluate

    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "heldout.txt"
        text.write_text(heldout_text(), encoding="utf-8")
        return evaluate(model_dir, str(text), tokens=tokens, ctx=ctx, show_progress=False).ppl


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m onecat.tiny_train``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(FIXTURES), help="parent directory (default: onecat/fixtures)")
    parser.add_argument("--family", choices=("qwen3_5", "qwen3_5_moe"), action="append")
    parser.add_argument("--steps", type=int, default=TrainSpec.steps)
    args = parser.parse_args(argv)
    for family in args.family or ["qwen3_5", "qwen3_5_moe"]:
        out = Path(args.out) / f"trained-{family}"
        record = train_model(TrainSpec(family, steps=args.steps), out)
        record["heldout_ppl"] = round(heldout_perplexity(out), 3)
        (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"{out}: held-out perplexity {record['heldout_ppl']}", file=sys.stderr)


if __name__ == "__main__":
    main()
