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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from metrale.engine.timings import ITERATION_TOKEN_BUCKETS, REQUEST_PHASES, REQUEST_TIME_BUCKETS, BucketCounts

logger = logging.getLogger(__name__)

#: The ``Content-Type`` of ``/metrics``.
CONTENT_TYPE = CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0)


#: vLLM's name of each engine metric (``vllm:``, with a ``model_name`` label), beside Metrale's
#: own: the dashboards written for vLLM read these. ``docs/serving.rst`` has the table.
VLLM_ENGINE_GAUGES = {
    "metrale_requests_running": "vllm:num_requests_running",
    "metrale_requests_waiting": "vllm:num_requests_waiting",
    "metrale_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
}
VLLM_ENGINE_COUNTERS = {
    "metrale_preemptions": "vllm:num_preemptions",
    "metrale_spec_decode_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "metrale_spec_decode_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
VLLM_ENGINE_HISTOGRAMS = {
    **{f"metrale_request_{phase}_time_seconds": f"vllm:request_{phase}_time_seconds" for phase in REQUEST_PHASES},
    "metrale_iteration_tokens": "vllm:iteration_tokens_total",
}
#: What each request phase histogram times (:mod:`metrale.engine.timings`).
PHASE_DOCS = {
    "queue": "From the engine receiving a request to its first scheduled step (finished requests).",
    "prefill": "From a request's first scheduled step to its first generated token (finished requests).",
    "decode": "From a request's first generated token to its last (finished requests).",
    "inference": "From a request's first scheduled step to its last token (finished requests).",
}


class EngineCollector(Collector):
    """The engine's load, read at scrape time: ``stats`` returns an
    :class:`~metrale.engine.driver.EngineStats` (it may raise once the engine is shut down: the
    gauges are then left out), ``active`` the requests submitted and not finished. With
    ``model_name``, vLLM's names of the same values follow (:data:`VLLM_ENGINE_GAUGES`,
    :data:`VLLM_ENGINE_COUNTERS`), labelled with it."""

    def __init__(self, stats: Callable[[], Any], active: Callable[[], int], model_name: str | None = None,
                 cache_config: Callable[[], dict[str, str] | None] | None = None) -> None:
        self._stats = stats
        self._active = active
        self._model_name = model_name
        self._cache_config = cache_config

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(None, 0, self._model_name) + self._cache_info({}))

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
            active = self._active()
        except Exception as error:  # the engine is shut down (its LLM closed)
            logger.debug("engine stats unavailable: %r", error)
            return iter(())
        families = self._families(stats, active, self._model_name)
        return iter(families + self._cache_info(self._cache_config() if self._cache_config is not None else None))

    def _cache_info(self, config: dict[str, str] | None) -> list[Metric]:
        """``metrale_cache_config_info`` (and vLLM's ``vllm:cache_config_info``): 1, labelled
        with the KV cache's settings (none when they are unknown)."""
        if config is None:
            return []
        names = sorted(config)
        own = GaugeMetricFamily("metrale_cache_config_info", "The KV cache's settings, as labels (the value is 1).",
                                labels=names)
        own.add_metric([config[name] for name in names], 1.0)
        if self._model_name is None:
            return [own]
        twin = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's settings (vLLM's name).",
                                 labels=["model_name", *names])
        twin.add_metric([self._model_name, *(config[name] for name in names)], 1.0)
        return [own, twin]

    @staticmethod
    def _families(stats: Any, active: int, model_name: str | None = None) -> list[Metric]:
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
        phases = stats.request_phases if stats is not None else {}
        histograms = [(f"metrale_request_{phase}_time_seconds", PHASE_DOCS[phase],
                       phases.get(phase) or BucketCounts(REQUEST_TIME_BUCKETS)) for phase in REQUEST_PHASES]
        histograms.append(("metrale_iteration_tokens", "Tokens computed per engine step (decode rows, prompt chunks, "
                           "verify rows).", (stats.iteration_tokens if stats is not None else None)
                           or BucketCounts(ITERATION_TOKEN_BUCKETS)))
        families: list[Metric] = [GaugeMetricFamily(name, doc, value=v) for name, doc, v in gauges]
        families += [CounterMetricFamily(name, doc, value=v) for name, doc, v in counters]
        families += [HistogramMetricFamily(name, doc, buckets=h.cumulative(), sum_value=h.total)
                     for name, doc, h in histograms]
        if model_name is None:
            return families
        for kinds, family_class, names in ((gauges, GaugeMetricFamily, VLLM_ENGINE_GAUGES),
                                           (counters, CounterMetricFamily, VLLM_ENGINE_COUNTERS)):
            for name, doc, v in kinds:
                if name in names:
                    family = family_class(names[name], f"{doc} (vLLM's name of {name})", labels=["model_name"])
                    family.add_metric([model_name], v)
                    families.append(family)
        for name, doc, h in histograms:
            twin = HistogramMetricFamily(VLLM_ENGINE_HISTOGRAMS[name], f"{doc} (vLLM's name of {name})",
                                         labels=["model_name"])
            twin.add_metric([model_name], h.cumulative(), sum_value=h.total)
            families.append(twin)
        return families


class _Both:
    """A metric of Metrale's name and its vLLM twin (labelled with the model's name), updated
    together: ``inc`` and ``observe`` reach both."""

    def __init__(self, own: Any, vllm: Any) -> None:
        self.own, self.vllm = own, vllm

    def inc(self, amount: float = 1.0) -> None:
        self.own.inc(amount)
        self.vllm.inc(amount)

    def observe(self, value: float) -> None:
        self.own.observe(value)
        self.vllm.observe(value)


class _FinishedBoth:
    """``metrale_request_finish`` by endpoint and reason, with vLLM's
    ``vllm:request_success_total`` by reason and model (its ``abort`` and ``error`` included, as
    vLLM's finished reasons)."""

    def __init__(self, own: Any, vllm: Any) -> None:
        self.own, self.vllm = own, vllm

    def labels(self, endpoint: str, finish_reason: str) -> _Both:
        return _Both(self.own.labels(endpoint, finish_reason), self.vllm.labels(finish_reason))


class _ModelLabelled:
    """A labelled metric with its ``model_name`` label given: ``labels(reason)``."""

    def __init__(self, metric: Any, model_name: str) -> None:
        self.metric, self.model_name = metric, model_name

    def labels(self, *values: str) -> Any:
        return self.metric.labels(self.model_name, *values)


class ServerMetrics:
    """Every metric of one app, in its own registry (see the module docstring). With
    ``model_name`` (the served model's), vLLM's names of the same metrics are kept beside
    Metrale's, each labelled ``model_name`` (``docs/serving.rst`` lists them one to one).
    ``cache_config`` gives the KV cache's settings as the labels of ``metrale_cache_config_info``
    (None: the metric is left out)."""

    def __init__(self, stats: Callable[[], Any], active: Callable[[], int], in_progress: Callable[[], int],
                 model_name: str | None = None, cache_config: Callable[[], dict[str, str] | None] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter("metrale_requests", "HTTP requests answered, by endpoint and HTTP status code.",
                                ["endpoint", "status"], registry=registry)
        self.finished: Any = Counter("metrale_request_finish", "Completions (choices) finished, by endpoint and finish reason "
                                "(stop, length, error, abort: aborted ones include those whose client went away).",
                                ["endpoint", "finish_reason"], registry=registry)
        self.prompt_tokens: Any = Counter("metrale_prompt_tokens", "Prompt tokens of the requests submitted to the engine.",
                                     registry=registry)
        self.generation_tokens: Any = Counter("metrale_generation_tokens", "Tokens generated and received by the server.",
                                         registry=registry)
        self.ttft: Any = Histogram("metrale_time_to_first_token_seconds",
                              "From a request's arrival to its first generated token.", buckets=TTFT_BUCKETS,
                              registry=registry)
        self.itl: Any = Histogram("metrale_inter_token_latency_seconds",
                             "Between consecutive generated tokens of a completion.", buckets=ITL_BUCKETS, registry=registry)
        self.e2e: Any = Histogram("metrale_e2e_request_latency_seconds",
                             "From a request's arrival to its last token (finished requests only).", buckets=E2E_BUCKETS,
                             registry=registry)
        progress = Gauge("metrale_http_requests_in_progress", "HTTP requests being answered (a stream counts until it ends).",
                         registry=registry)
        progress.set_function(lambda: float(in_progress()))
        registry.register(EngineCollector(stats, active, model_name, cache_config))
        if model_name is None:
            return
        labels = {"labelnames": ["model_name"], "registry": registry}

        def twin(kind: Any, name: str, doc: str, **options: Any) -> Any:
            return kind(name, doc, **labels, **options).labels(model_name)

        self.prompt_tokens = _Both(self.prompt_tokens, twin(Counter, "vllm:prompt_tokens", "Prompt tokens (vLLM's name)."))
        self.generation_tokens = _Both(self.generation_tokens,
                                       twin(Counter, "vllm:generation_tokens", "Generated tokens (vLLM's name)."))
        self.ttft = _Both(self.ttft, twin(Histogram, "vllm:time_to_first_token_seconds",
                                          "Time to the first token (vLLM's name).", buckets=TTFT_BUCKETS))
        self.itl = _Both(self.itl, twin(Histogram, "vllm:inter_token_latency_seconds",
                                        "Between generated tokens (vLLM's name).", buckets=ITL_BUCKETS))
        self.e2e = _Both(self.e2e, twin(Histogram, "vllm:e2e_request_latency_seconds",
                                        "Arrival to last token (vLLM's name).", buckets=E2E_BUCKETS))
        success = Counter("vllm:request_success", "Finished requests by finish reason (vLLM's name).",
                          ["model_name", "finished_reason"], registry=registry)
        self.finished = _FinishedBoth(self.finished, _ModelLabelled(success, model_name))


    def render(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return generate_latest(self.registry)
