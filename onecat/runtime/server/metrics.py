"""Prometheus metrics behind /metrics (text exposition format, prometheus_client).

Series that vLLM has carry vLLM's names, types, label names and histogram buckets (vLLM v1,
``vllm/v1/metrics/loggers.py``), so dashboards built for ``vllm serve`` work unchanged:
labels ``model_name`` (the served name) and ``engine`` (the data-parallel replica's index,
"0" for a single engine). Series vLLM has no counterpart for keep the ``onecat:`` prefix and
the ``engine`` label alone (GDN state slots and checkpoints, block counts, engine steps);
the request error counter has a ``status`` label.

Engine gauges and counters are read at scrape time from each replica's latest ``stats()``
snapshot (one series per replica). Request histograms are observed per engine request (per choice of ``n``, as
vLLM counts them) by ``RequestTimer``: the arrival at the server (the handler's start), the
engine's first scheduling of the request, and the time the engine thread handed each step's
outputs over (one observation per step, even when speculative decoding emits several tokens
in it, as vLLM's inter-token latency is per engine step). A request's histograms carry
the replica that served it (``RequestStream.engine_index``). Each app has its own registry,
so several servers can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("model_name", "engine")
"""vLLM's labels on every ``vllm:`` series."""
ENGINE_INDEX = "0"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
"""vLLM's buckets: time to first token, inter-token latency, and the per-request phases
(end to end, queue, inference, prefill, decode)."""

_VLLM_GAUGES = {
    "running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
    "waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
}
_VLLM_COUNTERS = {
    "prompt_tokens_total": ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens_total": ("vllm:generation_tokens", "Number of generation tokens processed."),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    "num_preemptions": ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    "spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    "spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
}
_ONECAT_GAUGES = {
    "free_kv_blocks": ("onecat:kv_blocks_free", "Free paged-KV blocks (full-attention layers)."),
    "total_kv_blocks": ("onecat:kv_blocks_total", "Paged-KV blocks in the cache."),
    "free_state_slots": ("onecat:state_slots_free", "Free recurrent-state slots (GDN layers)."),
    "total_state_slots": ("onecat:state_slots_total", "Recurrent-state slots."),
    "cached_kv_blocks": ("onecat:kv_blocks_cached", "Paged-KV blocks in the prefix cache (held or free)."),
    "state_checkpoints": ("onecat:state_checkpoints", "GDN state checkpoints held for prefix caching."),
    "total_state_checkpoints": ("onecat:state_checkpoints_capacity", "GDN state checkpoint rows."),
}
_ONECAT_COUNTERS = {
    "steps_total": ("onecat:engine_steps", "Engine steps (forward passes) scheduled."),
    "prompt_steps_total": ("onecat:engine_steps_with_prompt_tokens",
                           "Engine steps that computed prompt tokens (beside any decodes)."),
}


def token_buckets(max_value: int) -> list[int]:
    """vLLM's 1-2-5 buckets up to ``max_value`` (1, 2, 5, 10, 20, 50, ...), for token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


ReplicaStats = Callable[[], list[tuple[str, dict[str, Any]]]]
"""``(replica index, stats snapshot)`` of each replica that is up."""


class _EngineCollector(Collector):
    """Turns each replica's stats snapshot into gauges and counters at scrape time."""

    def __init__(self, replica_stats: ReplicaStats, model_name: str) -> None:
        self._replica_stats = replica_stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        replicas = self._replica_stats()
        labels = {index: [self._model_name, index] for index, _ in replicas}

        def vllm_family(family: Any, key: str) -> Metric | None:
            found = False
            for index, stats in replicas:
                if key in stats:
                    family.add_metric(labels[index], stats[key])
                    found = True
            return family if found else None

        for key, (name, doc) in _VLLM_GAUGES.items():
            if (family := vllm_family(GaugeMetricFamily(name, doc, labels=LABELS), key)) is not None:
                yield family
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=LABELS)
        for index, stats in replicas:
            if stats.get("total_kv_blocks"):
                usage.add_metric(labels[index], 1.0 - stats["free_kv_blocks"] / stats["total_kv_blocks"])
        if usage.samples:
            yield usage
        for key, (name, doc) in _VLLM_COUNTERS.items():
            if (family := vllm_family(CounterMetricFamily(name, doc, labels=LABELS), key)) is not None:
                yield family
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted tokens per draft position.", labels=[*LABELS, "position"])
        for index, stats in replicas:
            for position, value in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", ())):
                per_position.add_metric([*labels[index], str(position)], value)
        if per_position.samples:
            yield per_position
        for table, kind in ((_ONECAT_GAUGES, GaugeMetricFamily), (_ONECAT_COUNTERS, CounterMetricFamily)):
            for key, (name, doc) in table.items():
                family = kind(name, doc, labels=["engine"])
                for index, stats in replicas:
                    if key in stats:
                        family.add_metric([index], stats[key])
                if family.samples:
                    yield family


class RequestTimer:
    """The timing of one engine request (one choice), fed its outputs in order; observes
    vLLM's request histograms into ``metrics``.

    ``arrival``: ``time.monotonic()`` when the server received the request. Each output comes
    with the time the engine thread handed its step's outputs over (``RequestStream.output_at``).
    """

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def observe(self, output: Any, at: float, engine: str = "0") -> None:
        """Record ``output`` (a ``RequestOutput``) emitted at ``at`` by replica ``engine``:
        time to first token at the first output with tokens, inter-token latency at each
        later step, and the per-request histograms once it is finished."""
        m = self.metrics.for_engine(engine)
        if output.new_token_ids:
            if self.first_token_at is None:
                self.first_token_at = at
                m.time_to_first_token.observe(max(0.0, at - self.arrival))
            elif self.last_token_at is not None and at > self.last_token_at:
                m.inter_token_latency.observe(at - self.last_token_at)
            self.last_token_at = at
        if not output.finished:
            return
        m.success(output.finish_reason or "unknown").inc()
        m.e2e_request_latency.observe(max(0.0, at - self.arrival))
        m.request_prompt_tokens.observe(output.prompt_tokens)
        m.request_generation_tokens.observe(output.completion_tokens)
        queued_at = getattr(output, "queued_at", None)
        scheduled_at = getattr(output, "scheduled_at", None)
        if queued_at is None or scheduled_at is None:
            return
        m.request_queue_time.observe(max(0.0, scheduled_at - queued_at))
        m.request_inference_time.observe(max(0.0, at - scheduled_at))
        first = self.first_token_at if self.first_token_at is not None else at
        m.request_prefill_time.observe(max(0.0, first - scheduled_at))
        m.request_decode_time.observe(max(0.0, at - first))


_HISTOGRAMS = {
    "time_to_first_token": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                            TTFT_BUCKETS),
    "inter_token_latency": ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                            ITL_BUCKETS),
    "e2e_request_latency": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                            REQUEST_LATENCY_BUCKETS),
    "request_queue_time": ("vllm:request_queue_time_seconds",
                           "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS),
    "request_inference_time": ("vllm:request_inference_time_seconds",
                               "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS),
    "request_prefill_time": ("vllm:request_prefill_time_seconds",
                             "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS),
    "request_decode_time": ("vllm:request_decode_time_seconds",
                            "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS),
}
_TOKEN_HISTOGRAMS = {
    "request_prompt_tokens": ("vllm:request_prompt_tokens", "Number of prefill tokens processed."),
    "request_generation_tokens": ("vllm:request_generation_tokens", "Number of generation tokens processed."),
}


class EngineSeries:
    """The request series of one replica: each histogram of ``_HISTOGRAMS`` and
    ``_TOKEN_HISTOGRAMS`` (same attribute names) with its labels bound, and ``success(reason)``,
    the success counter of one finish reason."""

    def __init__(self, metrics: ServerMetrics, engine: str) -> None:
        labels = (metrics.model_name, engine)
        for attribute, histogram in metrics.histograms.items():
            setattr(self, attribute, histogram.labels(*labels))
        self._success = metrics.request_success
        self._labels = labels

    def success(self, reason: str) -> Any:
        """The success counter's child for finish reason ``reason``."""
        return self._success.labels(*self._labels, reason)


class ServerMetrics:
    """The registry of one server: engine stats, request histograms and outcome counters.

    ``stats`` is the single engine's stats snapshot, or ``replica_stats`` gives every
    replica's (``ReplicaSet.replica_stats``)."""

    def __init__(
        self,
        stats: Callable[[], dict[str, Any]] | None = None,
        model_name: str = "",
        max_model_len: int = 1,
        replica_stats: ReplicaStats | None = None,
    ) -> None:
        if replica_stats is None:
            if stats is None:
                raise ValueError("ServerMetrics needs stats or replica_stats")
            replica_stats = lambda: [(ENGINE_INDEX, stats())]  # noqa: E731
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(replica_stats, model_name))
        self.histograms = {
            attribute: Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)
            for attribute, (name, doc, buckets) in _HISTOGRAMS.items()
        }
        for attribute, (name, doc) in _TOKEN_HISTOGRAMS.items():
            self.histograms[attribute] = Histogram(name, doc, LABELS, buckets=token_buckets(max_model_len),
                                                   registry=self.registry)
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        self.request_errors = Counter(
            "onecat:request_errors",
            "Requests refused or failed, by HTTP status.",
            ["status"],
            registry=self.registry,
        )
        self._engines: dict[str, EngineSeries] = {}

    def for_engine(self, engine: str) -> EngineSeries:
        """The request series of replica ``engine``."""
        series = self._engines.get(engine)
        if series is None:
            series = self._engines[engine] = EngineSeries(self, engine)
        return series

    def request_timer(self, arrival: float) -> RequestTimer:
        """A timer for one engine request that arrived at ``arrival`` (``time.monotonic()``)."""
        return RequestTimer(self, arrival)

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)
