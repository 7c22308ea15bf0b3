"""Perplexity of a causal LM (fp checkpoint or AutoAWQ GEMM artifact) on a text.

The standard non-overlapping measure: the text is tokenised (the tokenizer's default
special tokens), its first ``tokens`` ids are cut into ``tokens // ctx`` windows of ``ctx``
ids, every window is run on its own (no state carried across windows), and each window
scores its ``ctx - 1`` next-token predictions. Perplexity is ``exp`` of the mean negative
log-likelihood over all scored predictions (equal windows, so it is also the mean over
windows of the per-window mean, as AutoAWQ and llm-awq compute it).

Text sources: a file path, ``builtin:pydoc`` (the running Python's pydoc topics, sorted by
key, joined by blank lines) or ``builtin:jargon`` (the glossary body of Debian's
``jargon-text``: ``jargon.txt.gz`` from its first ``:0:`` entry on, front matter skipped).
"""

from __future__ import annotations

import gzip
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from onecat.errors import OnecatError
from onecat.formats.checkpoint import Checkpoint
from onecat.formats.files import read_checkpoint_json
from onecat.formats.quant_config import AWQ_GEMM, FLOAT, detect_format
from onecat.quantize.calibration import pydoc_text

JARGON_PATHS = (
    Path("/usr/share/doc/jargon-text/jargon.txt.gz"),
    Path("/usr/share/jargon/jargon.txt.gz"),
    Path("/usr/share/doc/jargon-text/jargon.txt"),
)
"""Where Debian's ``jargon-text`` package puts the Jargon File (checked in this order)."""

JARGON_FIRST_ENTRY = ":0:"


@dataclass(frozen=True)
class EvalResult:
    """Perplexity of one model on one text: ``tokens`` ids were fed in ``windows`` windows
    of ``ctx`` ids; ``nll`` is the mean negative log-likelihood (nats) per prediction."""

    ppl: float
    nll: float
    tokens: int
    windows: int
    ctx: int

    def to_dict(self) -> dict:
        """The result as a JSON-friendly dict."""
        return asdict(self)


def jargon_path() -> Path:
    """The installed Jargon File of Debian's ``jargon-text``; OnecatError if it is absent."""
    for path in JARGON_PATHS:
        if path.is_file():
            return path
    raise OnecatError(
        "builtin:jargon needs the Debian package jargon-text (looked for "
        f"{', '.join(str(p) for p in JARGON_PATHS)}); install it with "
        "`apt-get install jargon-text` or pass --text FILE"
    )


def jargon_glossary_text() -> str:
    """The glossary body of the Jargon File: its text from the first ``:0:`` entry on."""
    path = jargon_path()
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    start = text.find(JARGON_FIRST_ENTRY)
    if start < 0:
        raise OnecatError(f"{path}: no {JARGON_FIRST_ENTRY!r} entry found; is it the Jargon File?")
    return text[start:]


def load_text(source: str) -> str:
    """Resolve an evaluation text: ``builtin:pydoc``, ``builtin:jargon`` or a UTF-8 file path."""
    if source == "builtin:pydoc":
        return pydoc_text()
    if source == "builtin:jargon":
        return jargon_glossary_text()
    if source.startswith("builtin:"):
        raise OnecatError(
            f"unknown text source {source!r}: use builtin:pydoc, builtin:jargon or a file path"
        )
    path = Path(source)
    if not path.is_file():
        raise OnecatError(
            f"evaluation text {source!r} does not exist or is not a file: pass a UTF-8 text "
            "file, builtin:pydoc or builtin:jargon"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise OnecatError(f"evaluation text {path} is not UTF-8 ({exc}); convert it first") from exc
    if not text.strip():
        raise OnecatError(f"evaluation text {path} is empty")
    return text


def tokenize_prefix(tokenizer, text: str, tokens: int, source: str = "text") -> torch.Tensor:
    """The first ``tokens`` ids of ``text`` (1-D int64); OnecatError if the text is shorter.

    Long texts are tokenised by growing prefixes, so an 8k-token evaluation of a megabyte of
    text does not tokenise all of it; a margin of ids at the cut is dropped so the kept ids
    equal those of tokenising the whole text.
    """
    margin = 64
    chars = max(4096, 8 * (tokens + margin))
    while True:
        piece = text[:chars]
        ids = tokenizer(piece, return_tensors="pt")["input_ids"][0]
        whole = chars >= len(text)
        if whole or len(ids) >= tokens + margin:
            break
        chars *= 2
    if len(ids) < tokens:
        raise OnecatError(
            f"{source} has only {len(ids)} tokens, fewer than --tokens {tokens}: pass a longer "
            f"text or --tokens {len(ids)} or less"
        )
    return ids[:tokens].to(torch.int64)


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    ctx: int,
    *,
    show_progress: bool = True,
    desc: str = "perplexity",
) -> EvalResult:
    """Perplexity of ``model`` over ``input_ids`` (1-D) in non-overlapping windows of ``ctx``.

    Ids after the last whole window are not used. Logits are scored in float32.
    """
    from tqdm.auto import tqdm

    if ctx < 2:
        raise OnecatError(f"--ctx {ctx} is too small: a window needs at least 2 tokens")
    windows = input_ids.numel() // ctx
    if windows == 0:
        raise OnecatError(
            f"only {input_ids.numel()} tokens to evaluate, fewer than one window of --ctx {ctx}: "
            "lower --ctx or raise --tokens"
        )
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64)
    bar = tqdm(range(windows), desc=desc, unit="window", disable=not show_progress)
    for w in bar:
        window = input_ids[w * ctx : (w + 1) * ctx].to(device)[None]
        logits = model(input_ids=window, use_cache=False).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum")
        total += nll.double().cpu()
        bar.set_postfix(ppl=f"{math.exp(total.item() / ((w + 1) * (ctx - 1))):.3f}")
    mean = total.item() / (windows * (ctx - 1))
    return EvalResult(ppl=math.exp(mean), nll=mean, tokens=windows * ctx, windows=windows, ctx=ctx)


def _read_config(path: Path) -> dict:
    if not (path / "config.json").is_file():
        raise OnecatError(
            f"{path} has no config.json: pass a checkpoint directory (fp or AutoAWQ GEMM)"
        )
    return read_checkpoint_json(path, "config.json")


def load_eval_model(model_path: str | Path, *, device: str = "cpu"):
    """Load (model, tokenizer) for evaluation in float32: an fp checkpoint directly, an
    AutoAWQ GEMM artifact dequantised on the CPU (see :mod:`onecat.quantize.awq_reader`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_path)
    if not path.is_dir():
        raise OnecatError(f"model {str(model_path)!r} is not a directory: pass a local checkpoint")
    config = _read_config(path)
    fmt = detect_format(config, f"{path}/config.json")
    if fmt.kind not in (FLOAT, AWQ_GEMM):
        raise OnecatError(
            f"{path}/config.json: quantization_config describes a {fmt.kind} checkpoint; "
            "onecat eval reads fp checkpoints and AutoAWQ GEMM ('awq') artifacts"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise OnecatError(f"{path}: cannot load its tokenizer ({exc})") from exc
    if fmt.kind == AWQ_GEMM:
        from onecat.quantize.awq_reader import load_awq_as_float

        model = load_awq_as_float(path)
    else:
        Checkpoint(path)  # every weight file inside the directory, before transformers reads it
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise OnecatError(f"{path}: cannot load the checkpoint ({exc})") from exc
    return model.to(device), tokenizer


def evaluate(
    model_path: str | Path,
    text: str = "builtin:pydoc",
    *,
    tokens: int = 8192,
    ctx: int = 512,
    device: str = "cpu",
    show_progress: bool = True,
) -> EvalResult:
    """Perplexity of the checkpoint or AWQ artifact at ``model_path`` on the first ``tokens``
    tokens of ``text`` (a file path, ``builtin:pydoc`` or ``builtin:jargon``) in windows of
    ``ctx`` tokens."""
    if tokens < 1 or ctx < 2:
        raise OnecatError(f"--tokens {tokens} / --ctx {ctx}: need tokens >= 1 and ctx >= 2")
    if tokens < ctx:
        raise OnecatError(f"--tokens {tokens} is smaller than one window of --ctx {ctx}")
    body = load_text(text)
    model, tokenizer = load_eval_model(model_path, device=device)
    limit = _max_positions(model)
    if limit is not None and ctx > limit:
        raise OnecatError(
            f"--ctx {ctx} exceeds the model's max_position_embeddings {limit}: lower --ctx"
        )
    ids = tokenize_prefix(tokenizer, body, tokens, source=text)
    return perplexity(model, ids, ctx, show_progress=show_progress)


def _max_positions(model: torch.nn.Module) -> int | None:
    config = model.config
    config = getattr(config, "text_config", None) or config
    return getattr(config, "max_position_embeddings", None)
