"""The server's Prometheus metrics, each app with its own :class:`~prometheus_client.CollectorRegistry`
(never the process-wide one, so several apps in one process do not mix their counts).

Counters and histograms are updated by the request handlers; the engine's gauges are read from
:meth:`metrale.AsyncLLM.stats` when ``/metrics`` is scraped (:class:`EngineCollector`), so they
are never stale. ``docs/serving.rst`` lists every metric.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

#: The ``Content-Type`` of ``/metrics``.
CONTENT_TYPE = CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0)


class EngineCollector(Collector):
    """The engine's load, read at scrape time: ``stats`` returns an
    :class:`~metrale.engine.driver.EngineStats` (it may raise once the engine is shut down: the
    gauges are then left out), ``active`` the requests submitted and not finished."""

    def __init__(self, stats: Callable[[], Any], active: Callable[[], int]) -> None:
        self._stats = stats
        self._active = active

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(None, 0))

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
            active = self._active()
        except Exception as error:  # the engine is shut down (its LLM closed)
            logger.debug("engine stats unavailable: %r", error)
            return iter(())
        return iter(self._families(stats, active))

    @staticmethod
    def _families(stats: Any, active: int) -> list[Metric]:
        def value(name: str) -> float:
            return float(getattr(stats, name)) if stats is not None else 0.0

        usage = float(stats.kv_cache_usage) if stats is not None else 0.0
        gauges = [
            ("metrale_requests_running", "Requests running on the engine (a request with n completions counts once).",
             value("running")),
            ("metrale_requests_waiting", "Requests queued for the engine.", value("waiting")),
            ("metrale_requests_active", "Requests submitted to the engine and not finished (running or waiting).",
             float(active)),
            ("metrale_kv_cache_usage_ratio", "Fraction of the KV cache blocks in use (0 to 1).", usage),
            ("metrale_kv_cache_blocks_used", "KV cache blocks in use (blocks kept only by the prefix cache count as free).",
             value("kv_blocks_used")),
            ("metrale_kv_cache_blocks_total", "KV cache blocks in all.", value("kv_blocks_total")),
            ("metrale_state_slots_used", "Recurrent-state slots in use (0 for models without recurrent layers).",
             value("state_slots_used")),
            ("metrale_state_slots_total", "Recurrent-state slots in all.", value("state_slots_total")),
            ("metrale_lora_slots_used", "LoRA adapter slots running requests hold (0 without LoRA).",
             value("lora_slots_used")),
            ("metrale_lora_slots_total", "LoRA adapter slots in all (max_loras; 0 without LoRA).",
             value("lora_slots_total")),
            ("metrale_lora_adapters_loaded", "LoRA adapter slots that hold an adapter.", value("lora_adapters_loaded")),
        ]
        counters = [
            ("metrale_prefix_cache_queries", "KV blocks looked up in the prefix cache.", value("prefix_queried_blocks")),
            ("metrale_prefix_cache_hits", "KV blocks the prefix cache supplied.", value("prefix_hit_blocks")),
            ("metrale_preemptions", "Preemptions (a request's cache freed, to be recomputed later).", value("preemptions")),
            ("metrale_engine_steps", "Engine steps.", value("steps")),
            ("metrale_spec_decode_verify_steps", "Speculative verify steps (speculative_config only).",
             value("spec_verify_steps")),
            ("metrale_spec_decode_draft_tokens", "Draft tokens proposed and verified.", value("spec_draft_tokens")),
            ("metrale_spec_decode_accepted_tokens", "Draft tokens the target model kept.", value("spec_accepted_tokens")),
        ]
        families: list[Metric] = [GaugeMetricFamily(name, doc, value=v) for name, doc, v in gauges]
        families += [CounterMetricFamily(name, doc, value=v) for name, doc, v in counters]
        return families


class ServerMetrics:
    """Every metric of one app, in its own registry (see the module docstring)."""

    def __init__(self, stats: Callable[[], Any], active: Callable[[], int], in_progress: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter("metrale_requests", "HTTP requests answered, by endpoint and HTTP status code.",
                                ["endpoint", "status"], registry=registry)
        self.finished = Counter("metrale_request_finish", "Completions (choices) finished, by endpoint and finish reason "
                                "(stop, length, error, abort: aborted ones include those whose client went away).",
                                ["endpoint", "finish_reason"], registry=registry)
        self.prompt_tokens = Counter("metrale_prompt_tokens", "Prompt tokens of the requests submitted to the engine.",
                                     registry=registry)
        self.generation_tokens = Counter("metrale_generation_tokens", "Tokens generated and received by the server.",
                                         registry=registry)
        self.ttft = Histogram("metrale_time_to_first_token_seconds",
                              "From a request's arrival to its first generated token.", buckets=TTFT_BUCKETS,
                              registry=registry)
        self.itl = Histogram("metrale_inter_token_latency_seconds",
                             "Between consecutive generated tokens of a completion.", buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("metrale_e2e_request_latency_seconds",
                             "From a request's arrival to its last token (finished requests only).", buckets=E2E_BUCKETS,
                             registry=registry)
        progress = Gauge("metrale_http_requests_in_progress", "HTTP requests being answered (a stream counts until it ends).",
                         registry=registry)
        progress.set_function(lambda: float(in_progress()))
        registry.register(EngineCollector(stats, active))

    def render(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return generate_latest(self.registry)
