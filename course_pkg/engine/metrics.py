"""The engine's metrics in a Prometheus registry, under the names vLLM v1 exports (chapter 09).

vLLM's server publishes these at ``/metrics``; operators graph and alert on them. Here the
same names live in a ``prometheus_client.CollectorRegistry`` (``llm.metrics_registry``), which
``prometheus_client.start_http_server(port, addr="127.0.0.1", registry=llm.metrics_registry)``
serves. Three kinds, as in vLLM v1:

* **gauges**, the state now: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (a fraction: 1 means every block is held);
* **counters**, totals since start (exposed with a ``_total`` suffix): ``vllm:prompt_tokens``,
  ``vllm:generation_tokens``, ``vllm:num_preemptions``, ``vllm:prefix_cache_queries`` and
  ``vllm:prefix_cache_hits`` (in tokens);
* **histograms**, one observation per request (per token gap for the inter-token latency), with
  vLLM's buckets: ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``. The inter-token
  latency is observed for every request at every step, so these are kept by ``EngineHistogram``
  (a bisect and two additions per observation; ``prometheus_client.Histogram`` spends 1.4 us on
  one, a fifth of a decode step's host time at 128 requests) and exposed through the registry
  as a custom collector, in the same text format.

An engine that speculates (chapter 14) also registers vLLM's speculative-decoding counters:
``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens``,
``vllm:spec_decode_num_accepted_tokens`` and ``vllm:spec_decode_num_accepted_tokens_per_pos``
(one child per draft position, label ``position``, 0-based).

An engine with a tier behind its device pool (chapter 15) registers vLLM's
``vllm:external_prefix_cache_queries`` and ``vllm:external_prefix_cache_hits`` (tokens asked of
the tier at first admissions, and found there), and five counters of its own, with the course's
prefix: ``course:kv_offload_blocks_stored``, ``_blocks_loaded``, ``_blocks_evicted``,
``_bytes_stored`` and ``_bytes_loaded`` (vLLM reports its connector's transfers through
connector-specific stats; these names are not claimed to be its).

Counters cannot be set, only increased, so ``update`` adds what the engine's totals grew by
since the last call. Two counters of this course carry its own prefix, not vLLM's, because vLLM
v1 has no swapping: ``course:num_swapped_out`` and ``course:num_swap_fallbacks`` (swap
preemptions recomputed because the CPU pool was full).
"""
from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# vLLM v1's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

GAUGES = {  # Prometheus name -> (EngineMetrics field, help)
    "vllm:num_requests_running": ("num_requests_running", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("num_requests_waiting", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
}
COUNTERS = {
    "vllm:prompt_tokens": ("prompt_tokens", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("generation_tokens", "Number of generation tokens processed."),
    "vllm:num_preemptions": ("num_preemptions", "Cumulative number of preemptions from the engine."),
    "vllm:prefix_cache_queries": ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    "course:num_swapped_out": ("num_swapped_out", "Preemptions that swapped the victim's blocks to the CPU pool."),
    "course:num_swap_fallbacks": ("num_swap_fallbacks", "Swap preemptions recomputed because the CPU pool was full."),
}
SPEC_DECODE_COUNTERS = {  # registered when the engine speculates (chapter 14), as in vLLM
    "vllm:spec_decode_num_drafts": ("spec_decode_num_drafts", "Number of spec decoding drafts."),
    "vllm:spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Number of draft tokens."),
    "vllm:spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
}
OFFLOAD_COUNTERS = {  # registered when the engine has a tier (chapter 15)
    "vllm:external_prefix_cache_queries": ("external_prefix_cache_queries",
                                           "External prefix cache queries from KV connector cross-instance cache "
                                           "sharing, in terms of number of queried tokens."),
    "vllm:external_prefix_cache_hits": ("external_prefix_cache_hits",
                                        "External prefix cache hits from KV connector cross-instance cache "
                                        "sharing, in terms of number of cached tokens."),
    "course:kv_offload_blocks_stored": ("kv_offload_blocks_stored", "Blocks copied into the tier."),
    "course:kv_offload_blocks_loaded": ("kv_offload_blocks_loaded", "Blocks copied from the tier to the device."),
    "course:kv_offload_blocks_evicted": ("kv_offload_blocks_evicted", "Blocks the tier gave up to make room."),
    "course:kv_offload_bytes_stored": ("kv_offload_bytes_stored", "Bytes copied into the tier."),
    "course:kv_offload_bytes_loaded": ("kv_offload_bytes_loaded", "Bytes copied from the tier to the device."),
    "course:kv_offload_disk_blocks_stored": ("kv_offload_disk_blocks_stored", "Blocks written to the disk tier."),
    "course:kv_offload_disk_blocks_loaded": ("kv_offload_disk_blocks_loaded", "Blocks read from the disk tier."),
}
SPEC_DECODE_PER_POS = ("vllm:spec_decode_num_accepted_tokens_per_pos",
                       "Accepted tokens per draft position.")
HISTOGRAMS = {  # Prometheus name -> (buckets, help)
    "vllm:time_to_first_token_seconds": (TTFT_BUCKETS, "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": (ITL_BUCKETS, "Histogram of inter-token latency in seconds."),
    "vllm:e2e_request_latency_seconds": (REQUEST_LATENCY_BUCKETS, "Histogram of e2e request latency in seconds."),
    "vllm:request_queue_time_seconds": (REQUEST_LATENCY_BUCKETS,
                                        "Histogram of time spent in WAITING phase for request."),
}


class PrometheusMetrics:
    """One engine's gauges, counters and histograms, labelled ``model_name`` and ``engine`` as in vLLM."""

    def __init__(self, model_name: str, engine: str = "0", num_speculative_tokens: int = 0, offload: bool = False):
        self.registry = CollectorRegistry()
        labels = dict(model_name=model_name, engine=engine)
        self.gauges = {name: Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)
                       for name, (_, doc) in GAUGES.items()}
        self.counter_fields = dict(COUNTERS, **(SPEC_DECODE_COUNTERS if num_speculative_tokens else {}),
                                   **(OFFLOAD_COUNTERS if offload else {}))
        self.counters = {name: Counter(name, doc, list(labels), registry=self.registry).labels(**labels)
                         for name, (_, doc) in self.counter_fields.items()}
        self.per_pos = []   # vLLM's per-position acceptance counter: one child per draft position
        if num_speculative_tokens:
            name, doc = SPEC_DECODE_PER_POS
            counter = Counter(name, doc, list(labels) + ["position"], registry=self.registry)
            self.per_pos = [counter.labels(**labels, position=str(p)) for p in range(num_speculative_tokens)]
        self._per_pos_counted = [0] * num_speculative_tokens
        self.histograms = {name: EngineHistogram(name, doc, buckets, labels) for name, (buckets, doc) in HISTOGRAMS.items()}
        for histogram in self.histograms.values():
            self.registry.register(histogram)
        self._counted = {name: 0 for name in self.counter_fields}   # totals already added to each counter

    def update(self, metrics) -> None:
        """Bring the gauges and counters to an ``EngineMetrics`` snapshot."""
        values = metrics.as_dict()
        for name, (field, _) in GAUGES.items():
            self.gauges[name].set(values[field])
        for name, (field, _) in self.counter_fields.items():
            grown = values[field] - self._counted[name]
            if grown > 0:
                self.counters[name].inc(grown)
                self._counted[name] = values[field]
        for p, (child, total) in enumerate(zip(self.per_pos, values["spec_decode_num_accepted_tokens_per_pos"])):
            if total > self._per_pos_counted[p]:
                child.inc(total - self._per_pos_counted[p])
                self._per_pos_counted[p] = total

    def observe_token(self, ttft: float | None, inter_token_latency: float | None) -> None:
        """A request sampled a token: its first (``ttft``) or a later one (the gap since the last)."""
        if ttft is not None:
            self.histograms["vllm:time_to_first_token_seconds"].observe(ttft)
        if inter_token_latency is not None:
            self.histograms["vllm:inter_token_latency_seconds"].observe(inter_token_latency)

    def observe_finished(self, e2e_latency: float, queue_time: float | None) -> None:
        """A request's output was handed out."""
        self.histograms["vllm:e2e_request_latency_seconds"].observe(e2e_latency)
        if queue_time is not None:
            self.histograms["vllm:request_queue_time_seconds"].observe(queue_time)


class EngineHistogram:
    """A Prometheus histogram observed by the engine's thread alone: per bucket the observations
    at or below its bound (``le``), their sum and count; a collector of the registry
    (``collect`` runs when the registry is read, from any thread, on a copy of the counts)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], labels: dict[str, str]):
        self.name, self.doc, self.bounds, self.labels = name, doc, tuple(buckets), labels
        self.counts = [0] * (len(self.bounds) + 1)   # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1   # the first bucket with value <= bound
        self.sum += value

    def collect(self):
        counts, total = list(self.counts), self.sum
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        bounds = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        family.add_metric(list(self.labels.values()), list(zip(bounds, accumulate(counts))), sum_value=total)
        yield family
