"""The engine: requests in, incremental outputs out, one scheduler step at a time.

Single-threaded: one thread calls every method (the server runs it in a loop thread).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from onecat.errors import OnecatError
from onecat.formats.files import contained_file
from onecat.runtime.config import EngineConfig
from onecat.runtime.engine.block_manager import BlockManager, StateCheckpoints, StateSlotPool
from onecat.runtime.engine.detokenizer import IncrementalDetokenizer
from onecat.runtime.engine.in_flight import OverlappedDecoding
from onecat.runtime.engine.model_runner import ModelRunner, pass_name
from onecat.runtime.engine.request_check import check_request
from onecat.runtime.engine.scheduler import Scheduler
from onecat.runtime.engine.sequence import Sequence, SequenceStatus
from onecat.runtime.engine.speculative import (
    SpeculationStats,
    SpeculativeConfig,
    SpeculativeDecoding,
)
from onecat.runtime.errors import RequestError
from onecat.runtime.layers.sampler import Sampler, TokenLogprobs, nonfinite_rows, sample_alone
from onecat.runtime.models.qwen3_5 import Qwen3_5ForCausalLM
from onecat.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from onecat.runtime.engine.executor import ModelFactory, TensorParallelRunner

logger = logging.getLogger(__name__)


class NonFiniteLogits(RuntimeError):
    """A request's logits held NaN or inf: its output would be garbage, so it ends with an error."""


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # incremental text (stop strings removed)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # finish_reason "error": what failed (the log has the traceback)
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    queued_at: float | None = None  # time.monotonic() when the engine queued the request
    scheduled_at: float | None = None  # time.monotonic() when first scheduled (None: never)


@dataclass(frozen=True)
class StepOutputs:
    """What a step kind (``in_flight.OverlappedDecoding``, ``speculative.SpeculativeDecoding``)
    does to the engine's requests besides running them: the engine's own output functions."""

    emit: Callable[..., RequestOutput]  # (seq, token, logprobs=None): its newest token, appended already
    append: Callable[..., RequestOutput]  # (seq, token, logprobs=None): append it, then emit
    fail: Callable[..., RequestOutput]  # (seq, exc, log=True): finish it with "error"
    nonfinite: Callable[..., NonFiniteLogits]  # (seq, pass_name=None, position=None): its error
    forward_failed: Callable[[list[tuple[Sequence, int]], Exception], list[RequestOutput]]


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; other names as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OnecatError(f"device {name!r} was asked for, but torch sees no CUDA GPU; use --device cpu")
    return device


def _generation_eos(path: Path) -> list[int]:
    """The eos ids of ``generation_config.json`` (none when it is missing or unreadable); a
    symlink leading out of the checkpoint is refused like any other file reference."""
    if not (path / "generation_config.json").exists():
        return []
    file = contained_file(path, "generation_config.json", where=str(path), entry="file")
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


class LLMEngine:
    """Continuous-batching Qwen3.5 engine over a checkpoint or packed artifact."""

    def __init__(self, config: EngineConfig) -> None:
        """Load ``config.model`` (fp16 on a GPU, fp32 on CPU) and its tokenizer. In fp16 a
        checkpoint whose config.json has no fp16 headroom plan is audited first
        (``runtime/fp16_audit.py``) and loaded with the plan derived."""
        from transformers import AutoTokenizer

        from onecat.runtime.engine.executor import create_runner
        from onecat.runtime.loader import read_model_config
        from onecat.runtime.sharding import check_shardable, load_model_shard

        device = resolve_device(config.device)
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        path = Path(config.model)
        read_model_config(path)  # a broken config.json is named here (as pack does), not blamed on the tokenizer
        check_shardable(path, config.tensor_parallel_size)  # before any worker starts
        speculation = SpeculativeConfig.parse(config.speculative_config)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as exc:
            raise OnecatError(f"{path}: cannot load the tokenizer ({exc}); copy the tokenizer files next to config.json") from None
        headroom = None
        if dtype == torch.float16:  # a checkpoint without a plan is audited first
            from onecat.runtime.fp16_audit import startup_plan

            headroom = startup_plan(path, tokenizer, device)
        factory = functools.partial(load_model_shard, path, mtp=speculation is not None, headroom=headroom)
        runner = create_runner(config, factory, device, dtype)
        self._setup(config, runner, tokenizer, _generation_eos(path))

    @classmethod
    def from_model(
        cls, config: EngineConfig, model: Qwen3_5ForCausalLM, tokenizer: Any | None = None
    ) -> LLMEngine:
        """An engine over an already built model (benchmarks build random packed models);
        without a tokenizer outputs carry token ids and empty text."""
        engine = cls.__new__(cls)
        if SpeculativeConfig.parse(config.speculative_config) is not None and model.mtp is None:
            raise OnecatError("--speculative-config: the model was built without its MTP head (mtp=True)")
        engine._setup(config, ModelRunner(config, model), tokenizer, [])
        return engine

    @classmethod
    def from_factory(cls, config: EngineConfig, factory: ModelFactory, tokenizer: Any | None = None) -> LLMEngine:
        """An engine whose model ``factory(device, dtype)`` builds (in every rank when
        ``config.tensor_parallel_size`` > 1: a picklable callable returning that rank's
        shard; benchmarks build random tensor-parallel models this way)."""
        from onecat.runtime.engine.executor import create_runner

        device = resolve_device(config.device)
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        engine = cls.__new__(cls)
        engine._setup(config, create_runner(config, factory, device, dtype), tokenizer, [])
        return engine

    def close(self) -> None:
        """Stop tensor-parallel worker processes (nothing to do on one device)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _setup(self, config: EngineConfig, runner: ModelRunner | TensorParallelRunner, tokenizer: Any | None, eos: list[int]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = config.served_model_name or Path(config.model).name
        # False in an engine-core process: the API process detokenises and finds stop strings
        self.detokenize = True
        self.runner = runner
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, config.kv_block_size, config.enable_prefix_caching)
        self.slots = StateSlotPool(self.runner.num_slots)
        # rows after the slots and the CUDA-graph scratch slot; None: no GDN layers, no states
        checkpoints = StateCheckpoints(self.runner.num_checkpoints, self.runner.num_slots + 1) if self.runner.gdn else None
        self.scheduler = Scheduler(
            self.block_manager, self.slots, self.runner.num_slots, config.max_num_batched_tokens,
            checkpoints, config.state_checkpoint_interval,
        )
        eos_ids = set(runner.model_config.eos_token_ids) | set(eos)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_token_ids = eos_ids
        self.sampler = Sampler(eos_token_ids=eos_ids)  # min_tokens masks EOS
        self.speculation = SpeculativeConfig.parse(config.speculative_config)
        self.speculation_stats = SpeculationStats()
        runner.warmup()  # decode graphs of every batch size, before any request waits on them
        self._sequences: dict[str, Sequence] = {}
        outputs = StepOutputs(self._emit, self._append, self._fail, self._nonfinite, self._forward_failed)
        self._overlapped = OverlappedDecoding(config, self.scheduler, runner, self.block_manager, outputs)
        self._speculative = None if self.speculation is None else SpeculativeDecoding(
            self.speculation, self.scheduler, runner, self.block_manager, self.speculation_stats, outputs
        )
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0

    # --- requests ----------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; RequestError when it cannot be served as asked."""
        if request_id in self._sequences:
            raise RequestError(f"request id {request_id!r} is already in use")
        check_request(prompt_token_ids, params, self.runner.model_config.vocab_size, self.max_model_len)
        generator = None
        if params.seed is not None and params.temperature > 0:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
        tokenizer = self.tokenizer if self.detokenize else None
        detok = IncrementalDetokenizer(tokenizer, params.stop, min_tokens=params.min_tokens)
        seq = Sequence(request_id, prompt_token_ids, params, detok, generator)
        self._sequences[request_id] = seq
        self.scheduler.add(seq)
        self._prompt_tokens_total += len(prompt_token_ids)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks and state slot (unknown ids are ignored)."""
        seq = self._sequences.pop(request_id, None)
        if seq is not None and seq.status != SequenceStatus.FINISHED:
            self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    def num_waiting(self) -> int:
        """Requests not yet scheduled."""
        return len(self.scheduler.waiting)

    def stats(self) -> dict[str, int]:
        """Counters for /metrics and tests."""
        points = self.scheduler.checkpoints
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "free_kv_blocks": self.block_manager.num_free,
            "total_kv_blocks": self.block_manager.num_blocks,
            "free_state_slots": self.slots.num_free,
            "total_state_slots": self.slots.num_slots,
            "prompt_tokens_total": self._prompt_tokens_total,
            "generation_tokens_total": self._generation_tokens_total,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            "steps_total": self.scheduler.steps,
            "prompt_steps_total": self.scheduler.prompt_steps,
            "num_preemptions": self.scheduler.preemptions,
            "cached_kv_blocks": self.block_manager.num_cached,
            "state_checkpoints": 0 if points is None else len(points),
            "total_state_checkpoints": 0 if points is None else points.num_rows,
            **self._speculation_counters(),
        }

    def _speculation_counters(self) -> dict[str, Any]:
        if self.speculation is None:
            return {}
        stats = self.speculation_stats
        return {
            "spec_decode_num_drafts": stats.num_drafts,
            "spec_decode_num_draft_tokens": stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(stats.accepted_per_position),
        }

    # --- stepping ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for each request that got a token.

        The step kind first: with speculation every step verifies and drafts
        (``engine/speculative.py``); with ``async_scheduling`` decode steps whose rows sample
        on the device overlap (``engine/in_flight.py``: the step after one is queued before
        its tokens are read); any other step is schedule -> run -> sample -> emit here.

        A request whose own sampling or detokenising raises is finished with
        ``finish_reason`` "error" (its blocks and slot freed) and the others carry on; so are
        the requests of a batch whose forward pass raised, when the engine can go on
        (``_forward_failed``). Any other exception means the engine's state is unknown.
        """
        if self.speculation is not None:
            return self._speculative.step(self.sampler)
        overlapped = self._overlapped
        if overlapped.in_flight is not None:
            outputs = overlapped.step(self.sampler)
            if outputs or overlapped.in_flight is not None:
                return outputs
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        if overlapped.overlaps(scheduled, self.sampler):
            return overlapped.start(scheduled, self.sampler)
        try:
            sampled, logits = self.runner.run(scheduled)
        except Exception as exc:
            return self._forward_failed(scheduled, exc)
        for seq, count in scheduled:
            seq.num_computed_tokens += count
        self.scheduler.commit(scheduled)  # new full blocks and state checkpoints enter the cache
        if not sampled:
            return []
        picks = self._sample(logits, sampled)
        return self._emit_picks(sampled, picks)

    def _sample(
        self, logits: torch.Tensor, sampled: list[Sequence]
    ) -> list[tuple[int, TokenLogprobs | None] | Exception]:
        """Each sampled sequence's token and logprobs, or what failed (its sampling, or its
        logits holding NaN or inf)."""
        try:
            result = self.sampler(logits, sampled)
            picks = list(zip(result.token_ids, result.logprobs, strict=True))
        except Exception:  # one request's settings (or logits processor) broke the batch: find which
            picks = [sample_alone(self.sampler, seq, logits[row : row + 1]) for row, seq in enumerate(sampled)]
        for row in torch.nonzero(nonfinite_rows(logits)).flatten().tolist():
            picks[row] = self._nonfinite(sampled[row])
        return picks

    def _emit_picks(
        self, sampled: list[Sequence], picks: list[tuple[int, TokenLogprobs | None] | Exception]
    ) -> list[RequestOutput]:
        """Append each sequence's token and emit it, or fail the sequence."""
        outputs = []
        for seq, pick in zip(sampled, picks, strict=True):
            try:  # free while nothing raises (Python 3.11+): no per-token cost
                outputs.append(self._fail(seq, pick) if isinstance(pick, Exception) else self._append(seq, *pick))
            except Exception as exc:
                outputs.append(self._fail(seq, exc))
        return outputs

    # --- outputs (the step kinds emit through these: ``StepOutputs``) -------------------------

    def _forward_failed(self, scheduled: list[tuple[Sequence, int]], exc: Exception) -> list[RequestOutput]:
        """Fail the requests of a batch whose forward pass raised, or re-raise ``exc``.

        A forward pass writes only the KV blocks and state slots of its own sequences (a slot
        is zeroed when it is handed out again, a block is written before it is read), so
        ending exactly those requests leaves the engine consistent, provided the device
        still works (a CUDA error can be sticky) and no tensor-parallel worker is out of step.
        """
        recoverable = isinstance(self.runner, ModelRunner)
        if recoverable and self.runner.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.runner.device)
            except Exception:
                recoverable = False
        if not recoverable:
            raise exc
        ids = ", ".join(seq.request_id for seq, _ in scheduled)
        logger.error("the forward pass failed; failing its requests %s", ids, exc_info=exc)
        return [self._fail(seq, exc, log=False) for seq, _ in scheduled]

    def runner_pass(self) -> str:
        """How the runner computed its last pass (decode graph, piecewise graphs, eager)."""
        return pass_name(self.runner)

    def _nonfinite(self, seq: Sequence, pass_name: str | None = None, position: int | None = None) -> NonFiniteLogits:
        """The error of ``seq`` whose logits for the token at ``position`` (default: its next
        one) were not finite; logged with what is known (request, output token, the pass that
        computed them), no guess at a cause."""
        step = (seq.num_tokens if position is None else position) - seq.num_prompt_tokens + 1
        where = pass_name or self.runner_pass()
        logger.error("request %s: non-finite logits (NaN or inf) for output token %d (pass: %s); "
                     "the request ends with an error", seq.request_id, step, where)
        return NonFiniteLogits(f"the model's logits for output token {step} were not finite (NaN or inf); "
                               f"pass: {where}")

    def _fail(self, seq: Sequence, exc: Exception, log: bool = True) -> RequestOutput:
        """Finish ``seq`` with ``finish_reason`` "error" after ``exc``; free its blocks and slot."""
        if log and not isinstance(exc, NonFiniteLogits):  # that one was logged where it was found
            logger.error("request %s failed in the engine step; the others carry on", seq.request_id,
                         exc_info=exc)
        if seq.status != SequenceStatus.FINISHED:
            self.scheduler.finish(seq, "error")
        self._sequences.pop(seq.request_id, None)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="error",
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_completion_tokens,
            error=f"{type(exc).__name__}: {exc}",
            queued_at=seq.queued_at,
            scheduled_at=seq.scheduled_at,
        )

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None) -> RequestOutput:
        seq.token_ids.append(token)
        return self._emit(seq, token, logprobs)

    def _emit(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None) -> RequestOutput:
        """The output of ``seq``'s newest token ``token`` (already in its token ids); finishes
        the request where it stops."""
        params = seq.params
        self._generation_tokens_total += 1
        reason = None
        is_stop_token = token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        )
        if is_stop_token:
            reason = "stop"
        elif seq.detokenizer.append(token):
            reason = "stop"
        elif seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._sequences.pop(seq.request_id, None)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token],
            new_text=seq.detokenizer.release(final=reason is not None),
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_completion_tokens,
            logprobs=None if logprobs is None else [logprobs],
            queued_at=seq.queued_at,
            scheduled_at=seq.scheduled_at,
        )

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams) -> list[str]:
        """Complete each prompt (text or token ids) offline; returns the completions' text."""
        texts = {}
        for i, prompt in enumerate(prompts):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.add_request(f"generate-{i}", ids, params)
            texts[f"generate-{i}"] = ""
        while self.has_unfinished_requests():
            for out in self.step():
                texts[out.request_id] += out.new_text
        return [texts[f"generate-{i}"] for i in range(len(prompts))]
