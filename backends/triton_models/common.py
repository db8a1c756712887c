"""Small helpers shared by the Triton-facing model classes (importable only inside the stub,
where `triton_python_backend_utils` exists)."""

from __future__ import annotations

import json
import locale
import logging
import queue
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.triton_models.pbtxt import ModelSettings, model_settings

if TYPE_CHECKING:
    from backends.runtime.engine import Engine

SEQUENCE_START = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
SEQUENCE_END = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


def setup_logging() -> None:
    # The stub's stdout/stderr land in the server log; give our loggers a plain format.
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")


def utf8_text() -> None:
    """Text in this process (files, subprocess output) decodes as UTF-8. The Triton stub embeds
    Python without its start-up locale work (no setlocale, no C-locale coercion, no UTF-8
    mode: PYTHONUTF8 and LANG are ignored), so text defaulted to ASCII and one non-ASCII
    character in a config.pbtxt (a comment, a parameter's value) failed the load. This is
    what `python` itself does in the C locale (PEP 538): LC_CTYPE set to C.UTF-8. File names
    stay ASCII (fixed at the stub's start): model_store.unnamable refuses other paths."""
    if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
        return
    for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
            return
        except locale.Error:
            continue
    logging.getLogger("tritonspec").warning(
        "no UTF-8 locale (C.UTF-8) on this system: files are read as %s, and a config.pbtxt with "
        "characters outside it cannot be read",
        locale.getpreferredencoding(False),
    )


def model_parameters(args: dict) -> dict[str, str]:
    """config.pbtxt `parameters` as a plain dict of strings."""
    params = json.loads(args["model_config"]).get("parameters", {})
    return {k: v["string_value"] for k, v in params.items()}


def parse_flag(params: dict[str, str], name: str, default: bool) -> bool:
    """A true/false parameter; anything else fails the load with the parameter's name."""
    value = params.get(name, "").strip().lower()
    if not value:
        return default
    if value not in ("true", "false"):
        raise ValueError(f'parameter {name} must be "true" or "false", got {params[name]!r}')
    return value == "true"


def initialize_model(args: dict) -> ModelSettings:
    """The start of every model's initialize: UTF-8 text, logging set up, then its settings."""
    setup_logging()
    utf8_text()
    return model_settings(model_parameters(args))


def model_repository(args: dict) -> Path:
    """The model repository holding this model (Triton passes the model's own directory)."""
    repository = Path(args["model_repository"])
    return repository.parent if repository.name == args["model_name"] else repository


def instance_device(args: dict, params: dict[str, str], log: logging.Logger) -> str:
    """The torch device of this model instance (backends/runtime/device.py's rule over its
    instance_group kind and GPU, the `device` parameter and $TRITONSPEC_DEVICE), logged."""
    from backends.runtime.device import resolve_device  # torch: not for a model standing by

    device, why = resolve_device(
        args.get("model_instance_kind", ""), args.get("model_instance_device_id", 0), params.get("device", "")
    )
    log.info("%s instance %s: device %s (%s)", args["model_name"], args.get("model_instance_name", ""), device, why)
    return device


def input_array(request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def input_ids(request: Any, name: str) -> list[int]:
    """A token-id input, with or without a leading batch dimension of 1."""
    array = input_array(request, name)
    return [] if array is None else array.reshape(-1).tolist()


def input_scalar(request: Any, name: str) -> Any:
    array = input_array(request, name)
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return value.item() if hasattr(value, "item") else value


def error_response(message: str) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


class ServingOrStandingBy:
    """The `verifier` and `drafter` models: `initialize` loads the model that serves
    (`serving`), or leaves it None while the orchestrators do that model's work in their own
    process; it then stands by, answering every request with `standby_message`."""

    serving: Any = None
    standby_message = ""

    def execute(self, requests: list) -> list:
        if self.serving is None:
            return [error_response(self.standby_message) for _ in requests]
        return self.serving.execute(requests)

    def finalize(self) -> None:
        finalize = getattr(self.serving, "finalize", None)
        if finalize is not None:
            finalize()


def bls(
    model_name: str,
    inputs: dict[str, np.ndarray],
    outputs: list[str],
    seq_id: int,
    flags: int = 0,
    parameters: dict | None = None,
) -> dict[str, np.ndarray]:
    """One synchronous BLS call into a sequence-batched, non-decoupled model."""
    request = pb_utils.InferenceRequest(
        model_name=model_name,
        inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()],
        requested_output_names=outputs,
        correlation_id=seq_id,
        flags=flags,
        parameters=parameters or {},
    )
    response = request.exec()
    if response.has_error():
        raise RuntimeError(response.error().message())
    found = {name: pb_utils.get_output_tensor_by_name(response, name) for name in outputs}
    return {name: tensor.as_numpy() for name, tensor in found.items() if tensor is not None}


class ActiveSequencesGauge:
    """`tritonspec_active_sequences{model=...}` on /metrics: per-sequence state held now.
    The family must outlive its metric, so both are kept here."""

    def __init__(self, model_name: str) -> None:
        self.family = pb_utils.MetricFamily(
            name="tritonspec_active_sequences",
            description="Sequences whose state (KV cache, draft context) this model holds",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.metric = self.family.Metric(labels={"model": model_name})
        self.value: int | None = None

    def set(self, value: int) -> None:
        if value != self.value:  # each update is a round trip to the server process
            self.metric.set(value)
            self.value = value


class PrefixCacheCounters:
    """vLLM's prefix cache counters on /metrics: prompt tokens looked up in the prefix cache,
    and of those the tokens found there (hit rate = hits / queries)."""

    def __init__(self, model_name: str, version: str) -> None:
        labels = {"model": model_name, "version": version}
        kind = pb_utils.MetricFamily.COUNTER
        self.families = [
            pb_utils.MetricFamily(
                name="vllm:prefix_cache_queries", description="Prefix cache queries, in tokens.", kind=kind
            ),
            pb_utils.MetricFamily(
                name="vllm:prefix_cache_hits", description="Prefix cache hits, in tokens.", kind=kind
            ),
        ]
        self.metrics = [family.Metric(labels=labels) for family in self.families]
        self.reported = [0, 0]

    def update(self, engine: Engine) -> None:
        """Bring the counters to the engine's totals (a round trip to the server only on a change)."""
        for i, (metric, total) in enumerate(zip(self.metrics, (engine.prefix_queries, engine.prefix_hits))):
            if total != self.reported[i]:
                metric.increment(total - self.reported[i])
                self.reported[i] = total


class SpecDecodeCounters:
    """Server-wide acceptance counters on /metrics, as vLLM names them (labels: model,
    method; per position also `position`). Rates: accepted / draft tokens; mean acceptance
    length: 1 + accepted / drafts."""

    _FAMILIES = {
        "drafts": ("tritonspec_spec_decode_num_drafts", "Verification steps that had drafts"),
        "draft_tokens": ("tritonspec_spec_decode_num_draft_tokens", "Draft tokens proposed"),
        "accepted": ("tritonspec_spec_decode_num_accepted_tokens", "Draft tokens accepted"),
        "per_position": (
            "tritonspec_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position",
        ),
        "fallbacks": (
            "tritonspec_spec_decode_drafter_fallbacks",
            "Requests that stopped speculating because the drafter failed (decoded plainly)",
        ),
    }

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.families = {
            key: pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.COUNTER)
            for key, (name, text) in self._FAMILIES.items()
        }
        self.metrics: dict[tuple, Any] = {}
        self.lock = threading.Lock()

    def _metric(self, key: str, method: str, position: int | None = None) -> Any:
        labels = {"model": self.model_name, "method": method}
        if position is not None:
            labels["position"] = str(position)
        ident = (key, method, position)
        if ident not in self.metrics:
            self.metrics[ident] = self.families[key].Metric(labels=labels)
        return self.metrics[ident]

    def add(self, method: str, acceptance: Any, fell_back: bool = False) -> None:
        """Add one finished request's AcceptanceStats, and whether its drafter failed."""
        if fell_back:
            with self.lock:
                self._metric("fallbacks", method).increment(1)
        if not acceptance.num_drafts:
            return
        with self.lock:
            self._metric("drafts", method).increment(acceptance.num_drafts)
            self._metric("draft_tokens", method).increment(acceptance.num_draft_tokens)
            self._metric("accepted", method).increment(acceptance.num_accepted_tokens)
            for position, count in enumerate(acceptance.accepted_per_position):
                self._metric("per_position", method, position).increment(count)


class ServingMetrics:
    """Request latency and token metrics on /metrics, named as vLLM names them (Triton's
    vLLM backend uses the same names and `model` / `version` labels): prompt and generation
    token counters, time to first token, inter-token latency and end-to-end latency
    histograms, requests running and waiting. Updates go through a thread of their own: each
    is a round trip to the server process, kept off the requests' path."""

    # vLLM's buckets (vllm/v1/metrics/loggers.py); inter-token latency gains three finer ones,
    # since a speculative step's tokens arrive milliseconds apart.
    # fmt: off
    TTFT_BUCKETS = [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
        40.0, 80.0, 160.0, 640.0, 2560.0,
    ]
    ITL_BUCKETS = [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
        5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    ]
    E2E_BUCKETS = [
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
        480.0, 960.0, 1920.0, 7680.0,
    ]
    # fmt: on

    def __init__(self, model_name: str, version: str) -> None:
        labels = {"model": model_name, "version": version}
        kinds = pb_utils.MetricFamily

        def metric(name: str, description: str, kind: int, buckets: list[float] | None = None) -> Any:
            family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
            self.families.append(family)  # a family must outlive its metrics
            return family.Metric(labels=labels, buckets=buckets) if buckets else family.Metric(labels=labels)

        self.families: list = []
        self.prompt_tokens = metric("vllm:prompt_tokens_total", "Number of prefill tokens processed.", kinds.COUNTER)
        self.generation_tokens = metric(
            "vllm:generation_tokens_total", "Number of generation tokens processed.", kinds.COUNTER
        )
        self.ttft = metric(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            kinds.HISTOGRAM,
            self.TTFT_BUCKETS,
        )
        self.itl = metric(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (per step: its gap / its tokens).",
            kinds.HISTOGRAM,
            self.ITL_BUCKETS,
        )
        self.e2e = metric(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            kinds.HISTOGRAM,
            self.E2E_BUCKETS,
        )
        self.running = metric("vllm:num_requests_running", "Number of requests being generated.", kinds.GAUGE)
        self.waiting = metric("vllm:num_requests_waiting", "Number of requests waiting for a worker.", kinds.GAUGE)
        self.updates: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._apply, name="spec-metrics", daemon=True)
        self.thread.start()

    def _apply(self) -> None:
        while (update := self.updates.get()) is not None:
            metric, method, value = update
            try:
                getattr(metric, method)(value)
            except Exception:  # a metric that cannot be written must not stop the others
                logging.getLogger("tritonspec.metrics").exception("could not update a metric")

    def _put(self, metric: Any, method: str, value: float) -> None:
        self.updates.put((metric, method, value))

    def arrived(self) -> None:
        self._put(self.waiting, "increment", 1)

    def started(self) -> None:
        self._put(self.waiting, "increment", -1)
        self._put(self.running, "increment", 1)

    def tokens(self, count: int, since_last: float, first: bool) -> None:
        """One step's output tokens, `since_last` seconds after the request arrived (first)
        or after the previous step's tokens."""
        self._put(self.generation_tokens, "increment", count)
        if first:
            self._put(self.ttft, "observe", since_last)
        else:
            self._put(self.itl, "observe", since_last / count)

    def finished(self, num_prompt_tokens: int, seconds: float | None) -> None:
        """A request is done; `seconds` from arrival to its last token (None: it failed)."""
        self._put(self.running, "increment", -1)
        if num_prompt_tokens:
            self._put(self.prompt_tokens, "increment", num_prompt_tokens)
        if seconds is not None:
            self._put(self.e2e, "observe", seconds)

    def close(self) -> None:
        self.updates.put(None)
        self.thread.join(timeout=5)
