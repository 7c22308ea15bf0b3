"""Prometheus metrics behind /metrics (text exposition format, prometheus_client).

Engine gauges and token counters are read from the engine thread's latest ``stats()``
snapshot at scrape time; request outcomes are counted by the handlers. Names follow vLLM's
(``vllm:num_requests_running`` -> ``onecat:num_requests_running``) so existing dashboards
map over. Each app has its own registry, so several servers can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_GAUGES = {
    "running": ("onecat:num_requests_running", "Requests being processed by the engine."),
    "waiting": ("onecat:num_requests_waiting", "Requests waiting to be scheduled."),
    "free_kv_blocks": ("onecat:kv_blocks_free", "Free paged-KV blocks (full-attention layers)."),
    "total_kv_blocks": ("onecat:kv_blocks_total", "Paged-KV blocks in the cache."),
    "free_state_slots": ("onecat:state_slots_free", "Free recurrent-state slots (GDN layers)."),
    "total_state_slots": ("onecat:state_slots_total", "Recurrent-state slots."),
    "cached_kv_blocks": ("onecat:kv_blocks_cached", "Paged-KV blocks in the prefix cache (held or free)."),
    "state_checkpoints": ("onecat:state_checkpoints", "GDN state checkpoints held for prefix caching."),
    "total_state_checkpoints": ("onecat:state_checkpoints_capacity", "GDN state checkpoint rows."),
}
_COUNTERS = {
    "prompt_tokens_total": ("onecat:prompt_tokens", "Prompt tokens processed."),
    "generation_tokens_total": ("onecat:generation_tokens", "Tokens generated."),
    "prefix_cache_queries": ("onecat:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("onecat:prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)."),
    "steps_total": ("onecat:engine_steps", "Engine steps (forward passes) scheduled."),
    "prompt_steps_total": ("onecat:engine_steps_with_prompt_tokens",
                           "Engine steps that computed prompt tokens (beside any decodes)."),
    "num_preemptions": ("onecat:num_preemptions", "Requests preempted (KV blocks taken back; recomputed later)."),
    "spec_decode_num_drafts": ("onecat:spec_decode_num_drafts", "Verify steps with drafts (speculative decoding)."),
    "spec_decode_num_draft_tokens": ("onecat:spec_decode_num_draft_tokens", "Draft tokens verified."),
    "spec_decode_num_accepted_tokens": ("onecat:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}


class _EngineCollector(Collector):
    """Turns the engine's stats snapshot into gauges and counters at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for key, (name, doc) in _GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=stats[key])
        for key, (name, doc) in _COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(name, doc, value=stats[key])
        if "spec_decode_num_accepted_tokens_per_pos" in stats:
            family = CounterMetricFamily(
                "onecat:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
                labels=["position"],
            )
            for position, value in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
                family.add_metric([str(position)], value)
            yield family


class ServerMetrics:
    """The registry of one server: engine stats plus request outcome counters."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.request_success = Counter(
            "onecat:request_success",
            "Requests finished, by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )
        self.request_errors = Counter(
            "onecat:request_errors",
            "Requests refused or failed, by HTTP status.",
            ["status"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)
