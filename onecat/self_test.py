"""``onecat doctor --self-test``: every engine path on the trained tiny models, checked
against a CPU fp32 reference, on the user's own machine.

There is no V100 in onecat's development loop, so this suite is how a V100 owner proves
onecat right on their card. It needs no download: the trained tiny Qwen3.5 checkpoints (dense
and MoE, with MTP heads) ship in ``onecat/fixtures``.

- Model: each fixture quantized round-to-nearest (4 bits, group 32) and packed into the
  Volta layout (cached under ``onecat``'s cache directory), so the GPU runs onecat's own
  W4A16 kernels.
- Reference: the same packed artifact on the CPU engine in fp32 (the CPU reference op
  dequantises exactly as the kernels do), eager, no prefix cache, no speculation, each prompt
  alone, synchronous steps.
- Paths (:func:`engine_paths`): eager / CUDA graphs x prefix cache off / on x speculative
  (MTP, :data:`NUM_DRAFTS` drafts) off / on x async scheduling on / off, each engine running
  two phases (:class:`Workload`): three prompts one at a time (batch 1; with the cache, the
  second and third hit what the ones before left) and then a ragged batch of eight (20-169
  tokens: four hit what the first phase left, three share a prefix among themselves). Chunks of :data:`CHUNK_TOKENS` tokens,
  blocks of 16 and GDN state checkpoints every 32 tokens put cache hits inside a prompt's
  chunks and checkpoints inside chunks. On CPU only eager exists: 16 paths per model.
- Checks: per request, greedy tokens equal to the reference's, and every generated step's
  logits within ``rtol`` times the request's largest reference |logit| (:data:`RTOL`).
  The prompts were picked so that the reference's top-1 logit leads the runner-up by at least
  twice the GPU tolerance at every step (on the machine that picked them; another tokenizer
  or CPU may give smaller leads). Tokens must be equal; they may part only at a step where
  the reference's own token leads the path's by at most twice the tolerance (a near tie, which
  logits within the tolerance cannot order), and such a row says so.
- With two or more GPUs: the dense model at ``tensor_parallel_size=2`` (graphs, cache, async).

:func:`run_self_test` returns :class:`Row` s; ``onecat doctor --self-test`` prints them with
the kernel self-tests of :mod:`onecat.kernels.doctor` and exits non-zero on any failure.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.table import Table

from onecat.errors import OnecatError
from onecat.formats.files import read_json

if TYPE_CHECKING:
    from onecat.runtime.config import EngineConfig

FAMILIES = ("qwen3_5", "qwen3_5_moe")
MAX_TOKENS = 8
"""Greedy tokens generated per request."""
NUM_DRAFTS = 3
"""MTP drafts per step on the speculative paths."""
MAX_STEPS = 1000
"""A phase that takes more engine steps than this hangs: reported as a failure."""
CHUNK_TOKENS = 48
"""``max_num_batched_tokens``: prompts of up to 169 tokens run in several chunks, and a cache
hit (a multiple of :data:`CHECKPOINT_TOKENS`) lands inside the chunk that would cover it."""
BLOCK_TOKENS = 16
CHECKPOINT_TOKENS = 32
"""``state_checkpoint_interval``: GDN states are saved every 32 tokens, so cache hits fall
at 32, 64, 96, ... and checkpoints fall inside 48-token chunks."""
GROUP_SIZE = 32
"""Quantization group size: the tiny models' narrowest input (the MoE experts' 64) allows it."""
RTOL = {"cpu": 1e-4, "cuda": 2e-2}
"""Largest allowed |logit - reference| over the request's largest reference |logit|.
CPU: fp32 against fp32, differing only in summation order (chunking, batching): ~1e-6
seen. CUDA: fp16 activations and fp32 accumulation against fp32; the same models run on the
CPU engine in fp16 differ from fp32 by at most 5e-3 (MoE) and 9e-4 (dense); 2e-2 leaves 4x
room for the kernels' other summation orders and is the bound the GPU engine tests use."""

PROMPTS_FILE = Path(__file__).resolve().parent / "fixtures" / "self_test_prompts.json"
"""The prompts: passages of the fixtures' training text (committed, so that every Python
version runs the same prompts: pydoc's text differs between versions) and ``[passage, token
count]`` lists ``batch1`` / ``batch8``, picked so that the reference's margins are large
(the file's ``about`` says how)."""


@dataclass(frozen=True)
class Workload:
    """The prompts of a run, by request id: ``b1-*`` one at a time, ``b8-*`` together."""

    batch1: dict[str, list[int]]
    batch8: dict[str, list[int]]

    @classmethod
    def load(cls, tokenizer, path: Path = PROMPTS_FILE) -> Workload:
        """Tokenize the prompts of ``path`` (prefixes of its passages) with ``tokenizer``."""
        spec = read_json(path)
        ids = {name: tokenizer.encode(text, add_special_tokens=False) for name, text in spec["passages"].items()}
        phases = {}
        for phase, tag in (("batch1", "b1"), ("batch8", "b8")):
            prompts = {}
            for i, (name, length) in enumerate(spec[phase]):
                if length > len(ids[name]):
                    raise OnecatError(f"{path}: passage {name!r} has {len(ids[name])} tokens, not {length}")
                prompts[f"{tag}-{i}"] = ids[name][:length]
            phases[phase] = prompts
        return cls(**phases)

    @property
    def prompts(self) -> dict[str, list[int]]:
        """Every prompt by request id."""
        return self.batch1 | self.batch8


@dataclass(frozen=True)
class EnginePath:
    """One combination of the engine's execution paths."""

    graphs: bool
    prefix_cache: bool
    speculative: bool
    async_scheduling: bool
    tensor_parallel: int = 1

    @property
    def name(self) -> str:
        """E.g. ``graphs cache spec async`` / ``eager - - sync``."""
        parts = [
            "graphs" if self.graphs else "eager",
            "cache" if self.prefix_cache else "-",
            "spec" if self.speculative else "-",
            "async" if self.async_scheduling else "sync",
        ]
        return (f"TP{self.tensor_parallel} " if self.tensor_parallel > 1 else "") + " ".join(parts)

    def engine_config(self, model: Path, device: str) -> EngineConfig:
        """The :class:`onecat.runtime.config.EngineConfig` of this path."""
        from onecat.runtime.config import EngineConfig

        return EngineConfig(
            model=str(model), device=device, max_model_len=256, max_num_seqs=8,
            max_num_batched_tokens=CHUNK_TOKENS, kv_block_size=BLOCK_TOKENS, num_kv_blocks=160,
            enforce_eager=not self.graphs, enable_prefix_caching=self.prefix_cache,
            state_checkpoint_interval=CHECKPOINT_TOKENS, async_scheduling=self.async_scheduling,
            speculative_config={"method": "mtp", "num_speculative_tokens": NUM_DRAFTS} if self.speculative else None,
            tensor_parallel_size=self.tensor_parallel,
        )  # fmt: skip


def engine_paths(device: str) -> list[EnginePath]:
    """Every path that exists on ``device`` ("cpu": no CUDA graphs)."""
    graphs = (False, True) if device.startswith("cuda") else (False,)
    return [
        EnginePath(g, c, s, a)
        for g in graphs for c in (False, True) for s in (False, True) for a in (True, False)
    ]  # fmt: skip


@dataclass
class Row:
    """One line of the report: a model, a path, a batch shape and what was found."""

    model: str
    path: str
    batch: str
    max_diff: float = float("nan")
    """Largest |logit - reference| over the request's largest reference |logit|."""
    tokens_equal: bool = False
    seconds: float = 0.0
    ok: bool = False
    detail: str = ""


@dataclass
class Reference:
    """The reference run of one prompt: greedy tokens and the logits of each step."""

    tokens: list[int]
    logits: torch.Tensor
    """``[MAX_TOKENS, vocab]`` fp32 on the CPU."""

    @property
    def scale(self) -> float:
        """The largest |logit| of the request: what the tolerance is relative to."""
        return float(self.logits.abs().max())

    def smallest_margin(self) -> float:
        """The smallest top-1 lead over the runner-up of the steps, relative to :attr:`scale`."""
        top = self.logits.topk(2, dim=-1).values
        return float((top[:, 0] - top[:, 1]).min()) / self.scale


@dataclass
class _Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    hits: int = 0
    overlapped: int = 0
    seconds: float = 0.0


# --- the packed model --------------------------------------------------------------------


def packed_model(family: str, cache: Path | None = None) -> Path:
    """The trained tiny ``family`` quantized round-to-nearest and packed (Volta layout), made
    once and kept under ``cache`` (default: onecat's cache directory, ``self-test/``), keyed
    by the fixture and the source of onecat's quantizer, packer and formats (a changed one
    makes a new artifact)."""
    from onecat.kernels.build import cache_dir
    from onecat.pack.writer import pack_checkpoint
    from onecat.quantize.pipeline import quantize_rtn
    from onecat.tiny_train import fixture_dir

    source = fixture_dir(family)
    if not (source / "config.json").is_file():
        raise OnecatError(f"the trained tiny model {source} is missing: reinstall onecat")
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json", "training.json"):
        digest.update((source / name).read_bytes())
    package = Path(__file__).resolve().parent
    for code in sorted(f for part in ("quantize", "pack", "formats") for f in (package / part).rglob("*.py")):
        digest.update(code.read_bytes())
    root = (cache or cache_dir() / "self-test").expanduser()
    out = root / f"{family}-rtn{GROUP_SIZE}-{digest.hexdigest()[:12]}"
    if (out / "onecat_manifest.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    awq = root / f"{out.name}-awq"
    quantize_rtn(source, awq, group_size=GROUP_SIZE, overwrite=True, show_progress=False)
    pack_checkpoint(awq, out, overwrite=True, show_progress=False)
    shutil.rmtree(awq, ignore_errors=True)
    return out


# --- running an engine --------------------------------------------------------------------


@contextmanager
def _recorded(engine, owners: dict[int, str]) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record the logits row of every token ``engine`` samples, per request id.

    Plain and overlapped steps: the runner's ``run`` returns each sampled row (a pass whose
    input tokens came from the step in flight also adds an entry under "overlapped steps").
    Speculative steps sample every token through ``speculative.accept`` (the rows of the pending token and
    its drafts): its kept rows are recorded, the request found by its ``SamplingParams``
    object (``owners``: ``id(params)`` -> request id). Rows are cloned on the device, so
    recording adds no host sync to overlapped steps."""
    from onecat.runtime.engine import speculative

    records: dict[str, list[torch.Tensor]] = defaultdict(list)
    if engine.speculation is None:
        run = engine.runner.run

        def spy_run(scheduled, *args):
            if args and args[0] is not None:  # input tokens taken on the device: an overlapped step
                records["overlapped steps"].append(torch.empty(0))
            seqs, logits = run(scheduled, *args)
            for seq, row in zip(seqs, logits, strict=True):
                records[seq.request_id].append(row.detach().float().clone())
            return seqs, logits

        engine.runner.run = spy_run
        try:
            yield records
        finally:
            del engine.runner.run
        return
    accept = speculative.accept

    def spy_accept(sampler, logits, drafts, params, generator, argmax=None):
        kept, token = accept(sampler, logits, drafts, params, generator, argmax)
        if id(params) in owners:
            records[owners[id(params)]].extend(logits[: kept + 1].detach().float().clone())
        return kept, token

    speculative.accept = spy_accept
    try:
        yield records
    finally:
        speculative.accept = accept


def _run_phase(engine, prompts: dict[str, list[int]], together: bool) -> _Run:
    """Run ``prompts`` greedily for :data:`MAX_TOKENS` tokens: all at once (``together``) or
    one at a time, each to its end before the next is added."""
    from onecat.runtime.sampling_params import SamplingParams

    result = _Run()
    hits = engine.stats()["prefix_cache_hits"]
    params = {rid: SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) for rid in prompts}
    start = time.perf_counter()
    with _recorded(engine, {id(p): rid for rid, p in params.items()}) as records:
        waves = [list(prompts)] if together else [[rid] for rid in prompts]
        for wave in waves:
            for rid in wave:
                engine.add_request(rid, prompts[rid], params[rid])
            for _ in range(MAX_STEPS):
                if not engine.has_unfinished_requests():
                    break
                for out in engine.step():
                    if out.finish_reason == "error":
                        raise OnecatError(f"request {out.request_id} failed in the engine: {out.error}")
                    result.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            else:
                raise OnecatError(f"the engine did not finish {wave} in {MAX_STEPS} steps")
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize(engine.runner.device)
        result.seconds = time.perf_counter() - start
        result.overlapped = len(records.pop("overlapped steps", []))
        result.logits = {rid: [row.cpu() for row in rows] for rid, rows in records.items()}
    result.hits = engine.stats()["prefix_cache_hits"] - hits
    return result


def reference_runs(model: Path, prompts: dict[str, list[int]]) -> dict[str, Reference]:
    """Each prompt alone on the CPU engine in fp32: eager, no cache, no speculation, sync."""
    from onecat.runtime.engine import LLMEngine

    config = EnginePath(False, False, False, False).engine_config(model, "cpu")
    engine = LLMEngine(config)
    run = _run_phase(engine, prompts, together=False)
    return {
        rid: Reference(run.tokens[rid], torch.stack(run.logits[rid][:MAX_TOKENS])) for rid in prompts
    }


def compare(ref: dict[str, Reference], run: _Run, rtol: float) -> tuple[float, bool, list[str], list[str]]:
    """``(largest relative logit difference, tokens all equal, problems, near ties)`` of
    ``run`` against the reference. Logits are compared while the tokens agree (the context is
    the same up to and including the first step whose token differs). Tokens that part where
    the reference's token leads the run's by more than twice ``rtol`` (of the largest |logit|)
    are a problem; by less, a near tie (listed, not a failure)."""
    worst, equal, problems, ties = 0.0, True, [], []
    for rid, expected in ref.items():
        tokens, rows = run.tokens.get(rid, []), run.logits.get(rid, [])
        if len(rows) < len(tokens):
            problems.append(f"{rid}: {len(rows)} logits rows recorded for {len(tokens)} tokens")
            continue
        for step, want in enumerate(expected.tokens[: len(tokens)]):
            diff = float((rows[step] - expected.logits[step]).abs().max().nan_to_num(float("inf")))
            rel = diff / expected.scale
            worst = max(worst, rel)
            if rel > rtol:
                problems.append(f"{rid} step {step}: logits differ by {rel:.2e} of the largest (> {rtol:.0e})")
                break
            if tokens[step] != want:
                lead = float(expected.logits[step][want] - expected.logits[step][tokens[step]]) / expected.scale
                if lead <= 2 * rtol:
                    ties.append(f"{rid} step {step}: near tie (reference lead {lead:.1e})")
                break
        if tokens != expected.tokens:
            equal = False
            if not any(t.startswith(f"{rid} step") for t in ties):
                problems.append(f"{rid}: tokens {tokens} != reference {expected.tokens}")
    return worst, equal, problems, ties


def _graph_problems(engine, path: EnginePath) -> list[str]:
    """A graphs path whose capture failed ran eagerly (the engine stays correct, logs it)."""
    runner = engine.runner
    if not path.graphs:
        return []
    problems = []
    if not runner.use_graphs:
        problems.append("CUDA graph capture failed: decode ran eagerly (see the log's warning)")
    from onecat.runtime.engine.prompt_graphs import supports_prompt_graphs

    if runner.prompt_graphs is None and supports_prompt_graphs(runner.model):
        problems.append("prompt-pass graphs were not captured: prompts ran eagerly (see the log's warning)")
    return problems


def run_path(family: str, model: Path, path: EnginePath, device: str, workload: Workload,
             refs: dict[str, Reference]) -> list[Row]:
    """One engine on ``path``: the batch-1 phase, then the ragged batch of 8; a row each."""
    from onecat.runtime.engine import LLMEngine

    rtol = RTOL["cuda" if device.startswith("cuda") else "cpu"]
    rows = [Row(family, path.name, "1"), Row(family, path.name, f"{len(workload.batch8)} ragged")]
    engine = None
    try:
        start = time.perf_counter()
        engine = LLMEngine(path.engine_config(model, device))
        started = time.perf_counter() - start
        for row, prompts, together in ((rows[0], workload.batch1, False), (rows[1], workload.batch8, True)):
            run = _run_phase(engine, prompts, together)
            worst, equal, problems, ties = compare({rid: refs[rid] for rid in prompts}, run, rtol)
            if path.prefix_cache and run.hits == 0:
                problems.append("the prefix cache had no hits")
            if not path.prefix_cache and run.hits:
                problems.append(f"{run.hits} prefix cache hits with the cache off")
            if path.async_scheduling and not path.speculative and not run.overlapped:
                problems.append("async scheduling never overlapped a step")
            problems += _graph_problems(engine, path)
            row.max_diff, row.tokens_equal, row.seconds = worst, equal, run.seconds
            row.ok = not problems
            notes = [f"{run.hits} cached tokens"] if path.prefix_cache else []
            if run.overlapped:
                notes.append(f"{run.overlapped} overlapped steps")
            if path.speculative:
                stats = engine.speculation_stats
                notes.append(f"drafts accepted {stats.num_accepted_tokens}/{stats.num_draft_tokens} (cumulative)")
            if row is rows[0]:
                notes.append(f"start {started:.1f} s")
            row.detail = "; ".join(problems[:3] + ties[:2] + notes)
    except Exception as exc:  # a crash is a result too: report it, go on with the next path
        logging.getLogger(__name__).exception("self-test path %s %s failed", family, path.name)
        for row in rows:
            if not row.detail:
                row.ok, row.detail = False, f"{type(exc).__name__}: {exc}"
    finally:
        if engine is not None:
            engine.close()
        del engine
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def run_self_test(
    device: str = "auto",
    families: tuple[str, ...] = FAMILIES,
    paths: list[EnginePath] | None = None,
    cache: Path | None = None,
    progress: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Every path of :func:`engine_paths` on ``device`` ("auto": CUDA when available) for
    each trained tiny model, plus tensor parallelism 2 on the dense one when there are two or
    more GPUs; one :class:`Row` per path and batch shape (``progress`` gets each as it
    comes). The first row of each model is its reference run (its smallest top-1 margin)."""
    from transformers import AutoTokenizer

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    rows: list[Row] = []

    def emit(new: list[Row]) -> None:
        rows.extend(new)
        for row in new:
            if progress is not None:
                progress(row)

    for family in families:
        model = packed_model(family, cache)
        workload = Workload.load(AutoTokenizer.from_pretrained(model))
        start = time.perf_counter()
        refs = reference_runs(model, workload.prompts)
        margin = min(ref.smallest_margin() for ref in refs.values())
        emit([Row(family, "reference (cpu fp32)", "1", 0.0, True, time.perf_counter() - start, True,
                  f"smallest top-1 margin {margin:.3f} of the largest |logit|")])
        for path in paths if paths is not None else engine_paths(device):
            emit(run_path(family, model, path, device, workload, refs))
        if family == "qwen3_5" and device.startswith("cuda") and paths is None and torch.cuda.device_count() >= 2:
            tp = EnginePath(True, True, False, True, tensor_parallel=2)
            emit(run_path(family, model, tp, device, workload, refs))
    return rows


# --- the report ---------------------------------------------------------------------------


def row_line(row: Row) -> str:
    """One row as a line of text (progress output while the suite runs)."""
    mark = "ok  " if row.ok else "FAIL"
    return (f"{mark} {row.model:12s} {row.path:24s} batch {row.batch:9s} diff {row.max_diff:8.2e} "
            f"tokens {'equal' if row.tokens_equal else 'DIFFER'} {row.seconds:6.2f} s  {row.detail}")  # fmt: skip


def report_table(rows: list[Row], title: str = "onecat self-test") -> Table:
    """A rich table of ``rows``: path x result (max logit diff, tokens equal, time)."""
    table = Table(title=title, title_justify="left")
    for name, justify in (("model", "left"), ("path", "left"), ("batch", "left"), ("max logit diff", "right"),
                          ("tokens", "left"), ("time s", "right"), ("result", "left"), ("detail", "left")):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for row in rows:
        table.add_row(
            row.model, row.path, row.batch, f"{row.max_diff:.2e}", "equal" if row.tokens_equal else "DIFFER",
            f"{row.seconds:.2f}", "[green]ok[/]" if row.ok else "[red]FAIL[/]", row.detail,
        )
    return table


def summary(rows: list[Row]) -> str:
    """``N paths on M models: ...``; a path is an engine configuration with a batch shape
    (the reference rows are not paths)."""
    paths = [row for row in rows if not row.path.startswith("reference")]
    failed = [row for row in rows if not row.ok]
    models = len({row.model for row in rows})
    return f"{len(paths)} paths on {models} models: " + (f"{len(failed)} failed" if failed else "all passed")
