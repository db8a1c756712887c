"""Small helpers shared by the Triton-facing model classes (importable only inside the stub,
where `triton_python_backend_utils` exists)."""
from __future__ import annotations

import json
import logging
import sys
import threading
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.runtime.device import resolve_device

SEQUENCE_START = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
SEQUENCE_END = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


def setup_logging() -> None:
    # The stub's stdout/stderr land in the server log; give our loggers a plain format.
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
    )


def model_parameters(args: dict) -> dict[str, str]:
    """config.pbtxt `parameters` as a plain dict of strings."""
    params = json.loads(args["model_config"]).get("parameters", {})
    return {k: v["string_value"] for k, v in params.items()}


def instance_device(args: dict, params: dict[str, str], log: logging.Logger) -> str:
    """The torch device of this model instance (backends/runtime/device.py's rule over its
    instance_group kind and GPU, the `device` parameter and $TRITONSPEC_DEVICE), logged."""
    device, why = resolve_device(args.get("model_instance_kind", ""), args.get("model_instance_device_id", 0),
                                 params.get("device", ""))
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


def bls(model_name: str, inputs: dict[str, np.ndarray], outputs: list[str], seq_id: int,
        flags: int = 0, parameters: dict | None = None) -> dict[str, np.ndarray]:
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


class SpecDecodeCounters:
    """Server-wide acceptance counters on /metrics, as vLLM names them (labels: model,
    method; per position also `position`). Rates: accepted / draft tokens; mean acceptance
    length: 1 + accepted / drafts."""

    _FAMILIES = {
        "drafts": ("tritonspec_spec_decode_num_drafts", "Verification steps that had drafts"),
        "draft_tokens": ("tritonspec_spec_decode_num_draft_tokens", "Draft tokens proposed"),
        "accepted": ("tritonspec_spec_decode_num_accepted_tokens", "Draft tokens accepted"),
        "per_position": ("tritonspec_spec_decode_num_accepted_tokens_per_pos",
                         "Draft tokens accepted at each draft position"),
    }

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.families = {key: pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.COUNTER)
                         for key, (name, text) in self._FAMILIES.items()}
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

    def add(self, method: str, acceptance: Any) -> None:
        """Add one finished request's AcceptanceStats."""
        if not acceptance.num_drafts:
            return
        with self.lock:
            self._metric("drafts", method).increment(acceptance.num_drafts)
            self._metric("draft_tokens", method).increment(acceptance.num_draft_tokens)
            self._metric("accepted", method).increment(acceptance.num_accepted_tokens)
            for position, count in enumerate(acceptance.accepted_per_position):
                self._metric("per_position", method, position).increment(count)
