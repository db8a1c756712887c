"""What tritonspec puts on Triton's /metrics, in one place: vLLM's metric set under vLLM's
names, with Triton's vLLM backend's types, `model` / `version` labels and buckets, so that
dashboards and autoscalers made for vLLM or for Triton's vLLM backend read a tritonspec
server unchanged; and tritonspec's extras (`tritonspec_*`: acceptance per drafting method,
drafter fallbacks).

Every metric exists from the model's start, at 0 (a dashboard of a fresh server shows 0,
not "no data"). Names are what a Prometheus scrape of vLLM shows: a counter's name carries
its `_total` (vLLM declares `vllm:spec_decode_num_drafts`, prometheus_client exposes
`vllm:spec_decode_num_drafts_total`; Triton's metric API exposes names as given).

References (names, types, buckets):
- Triton's vLLM backend, src/utils/metrics.py at 9b96279029abaf46fe38238998ec591b7857e331
  (https://github.com/triton-inference-server/vllm_backend/blob/9b96279029abaf46fe38238998ec591b7857e331/src/utils/metrics.py:
  its full set; r25.12, 231d53f78ba64860228c3a5a36f6528b92431e7a, keeps 8 of them), labels
  from its src/model.py: {"model": model name, "version": model version};
- vLLM V1, vllm/v1/metrics/loggers.py at 005a810bc40faa25b8870fbc8559c3462581eee3
  (kv_cache_usage_perc, request_success with `finished_reason`, inter_token_latency, the
  longer time-to-first-token and time-per-output-token buckets, build_1_2_5_buckets), and
  vllm/v1/spec_decode/metrics.py at 016a8587edb04ae53c913a1da9355a07dc0ca4ae (the spec-decode
  counters, `position` on the per-position one).

Two sources write them: the `speculative` model (requests: `ServingMetrics`, `RequestClock`,
`SpecDecodeCounters`) and whoever holds the verifier's KV pool, the `verifier` model or the
`speculative` model verifying in its process (`EngineMetrics`, labelled with the verifier's
name). Only a model's stub can create them (`triton_python_backend_utils`); the declared
names below import anywhere (tests read them).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backends.serving.kv_scheduler import KVStats

log = logging.getLogger("tritonspec.metrics")

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

# The `speculative` model's, labelled {model, version} (request_success_total also
# `finished_reason`, the per-position counter `position`): name -> (type, description).
SERVING_METRICS: dict[str, tuple[str, str]] = {
    "vllm:num_requests_running": (GAUGE, "Number of requests being generated."),
    "vllm:num_requests_waiting": (GAUGE, "Number of requests waiting to be processed."),
    "vllm:num_preemptions_total": (COUNTER, "Cumulative number of preemption from the engine."),
    "vllm:prompt_tokens_total": (COUNTER, "Number of prefill tokens processed."),
    "vllm:generation_tokens_total": (COUNTER, "Number of generation tokens processed."),
    "vllm:request_success_total": (COUNTER, "Count of successfully processed requests."),
    "vllm:time_to_first_token_seconds": (HISTOGRAM, "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": (
        HISTOGRAM,
        "Histogram of inter-token latency in seconds (per step: its gap / its tokens).",
    ),
    "vllm:time_per_output_token_seconds": (HISTOGRAM, "Histogram of time per output token in seconds."),
    "vllm:e2e_request_latency_seconds": (HISTOGRAM, "Histogram of end to end request latency in seconds."),
    "vllm:request_queue_time_seconds": (HISTOGRAM, "Histogram of time spent in WAITING phase for request."),
    "vllm:request_inference_time_seconds": (HISTOGRAM, "Histogram of time spent in RUNNING phase for request."),
    "vllm:request_prefill_time_seconds": (HISTOGRAM, "Histogram of time spent in PREFILL phase for request."),
    "vllm:request_decode_time_seconds": (HISTOGRAM, "Histogram of time spent in DECODE phase for request."),
    "vllm:request_prompt_tokens": (HISTOGRAM, "Number of prefill tokens processed."),
    "vllm:request_generation_tokens": (HISTOGRAM, "Number of generation tokens processed."),
    "vllm:request_params_n": (HISTOGRAM, "Histogram of the n request parameter."),
    "vllm:spec_decode_num_drafts_total": (COUNTER, "Number of spec decoding drafts."),
    "vllm:spec_decode_num_draft_tokens_total": (COUNTER, "Number of draft tokens."),
    "vllm:spec_decode_num_accepted_tokens_total": (COUNTER, "Number of accepted tokens."),
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": (COUNTER, "Accepted tokens per draft position."),
}
# The KV pool holder's, labelled {model, version} of the verifier.
ENGINE_METRICS: dict[str, tuple[str, str]] = {
    "vllm:kv_cache_usage_perc": (GAUGE, "KV-cache usage. 1 means 100 percent usage."),
    "vllm:iteration_tokens_total": (
        HISTOGRAM,
        "Histogram of number of tokens per engine_step (every sequence's new and draft tokens).",
    ),
    "vllm:prefix_cache_queries_total": (COUNTER, "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits_total": (COUNTER, "Prefix cache hits, in terms of number of cached tokens."),
}
# tritonspec's own, labelled {model, method} (per position also `position`).
SPEC_DECODE_EXTRAS: dict[str, tuple[str, str]] = {
    "tritonspec_spec_decode_num_drafts": (COUNTER, "Verification steps that had drafts"),
    "tritonspec_spec_decode_num_draft_tokens": (COUNTER, "Draft tokens proposed"),
    "tritonspec_spec_decode_num_accepted_tokens": (COUNTER, "Draft tokens accepted"),
    "tritonspec_spec_decode_num_accepted_tokens_per_pos": (COUNTER, "Draft tokens accepted at each draft position"),
    "tritonspec_spec_decode_drafter_fallbacks": (
        COUNTER,
        "Requests that stopped speculating because the drafter failed (decoded plainly)",
    ),
}
# vLLM V1's finish reasons (FinishReason) by tritonspec's; a failed request is no success.
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}

# fmt: off
TTFT_BUCKETS = [  # vLLM V1's (Triton's vLLM backend stops at 10.0)
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
]
# vLLM's, with three finer ones: a speculative step's tokens arrive milliseconds apart.
ITL_BUCKETS = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]
TPOT_BUCKETS = [  # vLLM V1's (Triton's vLLM backend stops at 2.5)
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
# fmt: on


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's build_1_2_5_buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def histogram_buckets(name: str, max_model_len: int) -> list[float]:
    """The buckets of one of the histograms above (token counts per request go to the context window)."""
    if name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        return build_1_2_5_buckets(max_model_len)
    fixed = {
        "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
        "vllm:inter_token_latency_seconds": ITL_BUCKETS,
        "vllm:time_per_output_token_seconds": TPOT_BUCKETS,
        "vllm:iteration_tokens_total": ITERATION_TOKENS_BUCKETS,
        "vllm:request_params_n": PARAMS_N_BUCKETS,
    }
    return fixed.get(name, REQUEST_LATENCY_BUCKETS)


class Families:
    """Metric families of one model, kept for as long as their metrics (a family must outlive
    its metrics), and the metrics made from them."""

    def __init__(self, declared: dict[str, tuple[str, str]], max_model_len: int = 0) -> None:
        import triton_python_backend_utils as pb_utils  # only a model's stub has it

        kinds = {COUNTER: pb_utils.MetricFamily.COUNTER, GAUGE: pb_utils.MetricFamily.GAUGE}
        kinds[HISTOGRAM] = pb_utils.MetricFamily.HISTOGRAM
        self.declared, self.max_model_len = declared, max_model_len
        self.families = {
            name: pb_utils.MetricFamily(name=name, description=text, kind=kinds[kind])
            for name, (kind, text) in declared.items()
        }

    def metric(self, name: str, labels: dict[str, str]) -> Any:
        if self.declared[name][0] == HISTOGRAM:
            buckets = [float(b) for b in histogram_buckets(name, self.max_model_len)]
            return self.families[name].Metric(labels=labels, buckets=buckets)
        return self.families[name].Metric(labels=labels)


class MetricWriter:
    """Metric updates applied by a thread of their own, in batches: each update is a round trip
    to the server process (20-50 us measured in a Triton Python model on a 2-core Zen 4), several
    a decoding step, so the thread gathers what arrives within `FLUSH_S` and writes each
    counter's increments as one and each gauge's last value only (histogram observations stay
    one each). Counters and gauges are written before the batch's observations, so a reader that
    sees a request's last observation sees everything queued before it."""

    FLUSH_S = 0.05

    def __init__(self, name: str) -> None:
        self.updates: queue.Queue = queue.Queue()
        self.wait_for_step: Callable[[float], None] | None = None
        self.thread = threading.Thread(target=self._apply, name=name, daemon=True)
        self.thread.start()

    def _apply(self) -> None:
        while (first := self.updates.get()) is not None:
            time.sleep(self.FLUSH_S)  # let a few steps' updates gather
            if self.wait_for_step is not None:
                self.wait_for_step(self.FLUSH_S)
            batch, closed = [first], False
            while not self.updates.empty():
                if (update := self.updates.get()) is None:
                    closed = True
                    break
                batch.append(update)
            self._write(batch)
            if closed:
                return

    @staticmethod
    def _write(batch: list[tuple[Any, str, float]]) -> None:
        totals: dict[int, list] = {}  # id(metric) -> [metric, method, value]: increments summed, last set
        observed = []
        for metric, method, value in batch:
            if method == "observe":
                observed.append((metric, method, value))
            elif method == "increment" and id(metric) in totals:
                totals[id(metric)][2] += value
            else:
                totals[id(metric)] = [metric, method, value]
        for metric, method, value in [*totals.values(), *observed]:
            if method == "increment" and value == 0:
                continue  # a gauge's ups and downs that cancel out
            try:
                getattr(metric, method)(value)
            except Exception:  # a metric that cannot be written must not stop the others
                log.exception("could not update a metric")

    def put(self, metric: Any, method: str, value: float) -> None:
        self.updates.put((metric, method, value))

    def close(self) -> None:
        self.updates.put(None)
        self.thread.join(timeout=5)


class ServingMetrics:
    """The `speculative` model's request metrics. `vllm:num_requests_waiting` counts requests
    waiting for one of its `max_concurrent_requests` workers and, with the verifier in this
    process, those waiting for KV room (`admission_waiting`); `vllm:num_preemptions_total` the
    KV scheduler's preemptions (`preempted`; both reported by `EngineMetrics`)."""

    def __init__(self, model_name: str, version: str, max_model_len: int) -> None:
        self.labels = {"model": model_name, "version": version}
        declared = {name: entry for name, entry in SERVING_METRICS.items() if "spec_decode" not in name}
        self.families = Families(declared, max_model_len)
        self.m = {
            name: self.families.metric(name, self.labels) for name in declared if name != "vllm:request_success_total"
        }
        self.success = {
            reason: self.families.metric("vllm:request_success_total", {**self.labels, "finished_reason": reason})
            for reason in sorted(set(FINISHED_REASONS.values()))
        }
        self.writer = MetricWriter("spec-metrics")

    def put(self, name: str, method: str, value: float) -> None:
        self.writer.put(self.m[name], method, value)

    def arrived(self) -> None:
        self.put("vllm:num_requests_waiting", "increment", 1)

    def admission_waiting(self, delta: int) -> None:
        """Requests entering (+) or leaving (-) an admission queue (the production issue's)."""
        self.put("vllm:num_requests_waiting", "increment", delta)

    def preempted(self, count: int = 1) -> None:
        """Requests preempted (their KV cache taken back to make room)."""
        self.put("vllm:num_preemptions_total", "increment", count)

    def started(self, arrived: float) -> RequestClock:
        """A worker took the request that arrived at `arrived` (time.perf_counter())."""
        now = time.perf_counter()
        self.put("vllm:num_requests_waiting", "increment", -1)
        self.put("vllm:num_requests_running", "increment", 1)
        self.put("vllm:request_queue_time_seconds", "observe", now - arrived)
        return RequestClock(self, arrived, now)

    def close(self) -> None:
        self.writer.close()


class RequestClock:
    """One request's times: arrival, start on a worker, first and latest tokens; its
    histograms are observed when it finishes, with a token or more out."""

    def __init__(self, metrics: ServingMetrics, arrived: float, started: float) -> None:
        self.metrics, self.arrived, self.started = metrics, arrived, started
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.num_tokens = 0
        self.finish_reason: str | None = None  # "stop", "length", "cancelled" once known

    def tokens(self, count: int) -> None:
        """A step's `count` output tokens came out now: time to first token, or the gap since
        the previous step's tokens per token (inter-token latency and time per output token)."""
        now, put = time.perf_counter(), self.metrics.put
        put("vllm:generation_tokens_total", "increment", count)
        if self.last_at is None:
            self.first_at = now
            put("vllm:time_to_first_token_seconds", "observe", now - self.arrived)
        else:
            per_token = (now - self.last_at) / count
            put("vllm:inter_token_latency_seconds", "observe", per_token)
            put("vllm:time_per_output_token_seconds", "observe", per_token)
        self.last_at, self.num_tokens = now, self.num_tokens + count

    def finished(self, num_prompt_tokens: int, params_n: int = 1) -> None:
        """`params_n`: the client request's n (the OpenAI front end's choices per prompt), 0 for
        a choice counted with its prompt's first."""
        put = self.metrics.put
        put("vllm:num_requests_running", "increment", -1)
        if num_prompt_tokens:
            put("vllm:prompt_tokens_total", "increment", num_prompt_tokens)
        reason = FINISHED_REASONS.get(self.finish_reason or "")
        if reason is not None:
            self.metrics.writer.put(self.metrics.success[reason], "increment", 1)
        if self.first_at is None or self.last_at is None:
            return
        if params_n:
            put("vllm:request_params_n", "observe", params_n)
        for name, value in (
            ("vllm:e2e_request_latency_seconds", self.last_at - self.arrived),
            ("vllm:request_inference_time_seconds", self.last_at - self.started),
            ("vllm:request_prefill_time_seconds", self.first_at - self.started),
            ("vllm:request_decode_time_seconds", self.last_at - self.first_at),
            ("vllm:request_prompt_tokens", num_prompt_tokens),
            ("vllm:request_generation_tokens", self.num_tokens),
        ):
            put(name, "observe", value)


class SpecDecodeCounters:
    """Server-wide acceptance counters: vLLM's (labels model, version; per position also
    `position`) and tritonspec's per drafting method (model, method) with drafter fallbacks.
    Rates: accepted / draft tokens; mean acceptance length: 1 + accepted / drafts. Written
    synchronously (once per request), so a client reading /metrics right after its request
    finished sees it."""

    def __init__(self, model_name: str, version: str, method: str | None, num_speculative_tokens: int) -> None:
        self.labels = {"model": model_name, "version": version}
        self.model_name = model_name
        declared = {name: entry for name, entry in SERVING_METRICS.items() if "spec_decode" in name}
        self.vllm = Families(declared)
        self.extras = Families(SPEC_DECODE_EXTRAS)
        self.metrics: dict[tuple, Any] = {}
        self.lock = threading.Lock()
        for name in declared:  # at 0 from the start, each draft position included
            for position in range(num_speculative_tokens) if name.endswith("_per_pos_total") else (None,):
                self._vllm(name, position)
        if method is not None:
            for name in SPEC_DECODE_EXTRAS:
                for position in range(num_speculative_tokens) if name.endswith("_per_pos") else (None,):
                    self._extra(name, method, position)

    def _vllm(self, name: str, position: int | None = None) -> Any:
        key = (name, position)
        if key not in self.metrics:
            labels = self.labels if position is None else {**self.labels, "position": str(position)}
            self.metrics[key] = self.vllm.metric(name, labels)
        return self.metrics[key]

    def _extra(self, name: str, method: str, position: int | None = None) -> Any:
        key = (name, method, position)
        if key not in self.metrics:
            labels = {"model": self.model_name, "method": method}
            if position is not None:
                labels["position"] = str(position)
            self.metrics[key] = self.extras.metric(name, labels)
        return self.metrics[key]

    def add(self, method: str, acceptance: Any, fell_back: bool = False) -> None:
        """Add one finished request's AcceptanceStats, and whether its drafter failed."""
        with self.lock:
            if fell_back:
                self._extra("tritonspec_spec_decode_drafter_fallbacks", method).increment(1)
            if not acceptance.num_drafts:
                return
            for suffix, value in (
                ("num_drafts", acceptance.num_drafts),
                ("num_draft_tokens", acceptance.num_draft_tokens),
                ("num_accepted_tokens", acceptance.num_accepted_tokens),
            ):
                self._vllm(f"vllm:spec_decode_{suffix}_total").increment(value)
                self._extra(f"tritonspec_spec_decode_{suffix}", method).increment(value)
            for position, count in enumerate(acceptance.accepted_per_position):
                self._vllm("vllm:spec_decode_num_accepted_tokens_per_pos_total", position).increment(count)
                self._extra("tritonspec_spec_decode_num_accepted_tokens_per_pos", method, position).increment(count)


class EngineMetrics:
    """What the verifier's engine knows, for whoever holds its KV pool: KV cache usage
    (reserved / capacity: vLLM's usage counts blocks held by running sequences, cached
    prefixes nobody holds are free), tokens per engine step, and the prefix cache counters
    (0 without prefix caching). `stepped` after each forward, `update` after each batch of
    steps and releases."""

    def __init__(self, model_name: str, version: str, runner: Any, serving: ServingMetrics | None = None) -> None:
        """`runner`: the TargetRunner (its engine's prefix counters, its scheduler's `kv_stats`).
        With the orchestrator's `serving` metrics in the same process, requests waiting for KV
        room count in `vllm:num_requests_waiting` and preemptions in
        `vllm:num_preemptions_total`, as vLLM's scheduler reports them."""
        self.engine, self.kv_stats, self.serving = runner.engine, runner.kv_stats, serving
        self.families = Families(ENGINE_METRICS)
        labels = {"model": model_name, "version": version}
        self.m = {name: self.families.metric(name, labels) for name in ENGINE_METRICS}
        self.reported = {"usage": 0.0, "queries": 0, "hits": 0, "waiting": 0, "preemptions": 0}
        self.writer = MetricWriter("engine-metrics")

    def stepped(self, steps: Sequence[Any]) -> None:
        """A forward ran over `steps` (VerifyRequests)."""
        if steps:
            tokens = sum(len(s.new_token_ids) + len(s.draft_token_ids) for s in steps)
            self.writer.put(self.m["vllm:iteration_tokens_total"], "observe", tokens)

    def update(self) -> None:
        """Bring usage and the prefix counters to the engine's (after steps and releases): only
        what changed is written."""
        stats = self.kv_stats()
        usage = stats.kv_usage
        if usage != self.reported["usage"]:
            self.writer.put(self.m["vllm:kv_cache_usage_perc"], "set", usage)
            self.reported["usage"] = usage
        if self.serving:
            self._report_queue(stats)
        # The prefix counters synchronously: a client that reads /metrics after its request sees them.
        for key, total in (("queries", self.engine.prefix_queries), ("hits", self.engine.prefix_hits)):
            if total != self.reported[key]:
                self.m[f"vllm:prefix_cache_{key}_total"].increment(total - self.reported[key])
                self.reported[key] = total

    def _report_queue(self, stats: KVStats) -> None:
        waiting = stats.num_waiting - self.reported["waiting"]
        if waiting:
            self.serving.admission_waiting(waiting)
        preempted = stats.num_preemptions - self.reported["preemptions"]
        if preempted:
            self.serving.preempted(preempted)
        self.reported["waiting"], self.reported["preemptions"] = stats.num_waiting, stats.num_preemptions
