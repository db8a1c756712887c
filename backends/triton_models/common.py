"""Small helpers shared by the Triton-facing model classes (importable only inside the stub,
where `triton_python_backend_utils` exists)."""

from __future__ import annotations

import json
import locale
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.triton_models.pbtxt import ModelSettings, model_settings

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


def error_response(message: str, retryable: bool = False) -> Any:
    """A response with the error `message`; `retryable`: Triton's UNAVAILABLE (say so in the message
    too: Triton's HTTP /generate answers every error of a response with 400)."""
    if retryable:
        error = pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE)
    else:
        error = pb_utils.TritonError(message)  # Triton's default code, as every other error here
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


class ServingOrStandingBy:
    """The `verifier` and `drafter` models: `initialize` loads the model that serves
    (`serving`), or leaves it None while the orchestrators do that model's work in their own
    process (`stand_by`); it then answers every request with `standby_message`, and ends its
    sequence (sequence_end.py: a refused sequence holds no slot)."""

    serving: Any = None
    standby_message = ""
    ender: Any = None

    def stand_by(self, args: dict, message: str) -> None:
        from backends.triton_models.sequence_end import SequenceEnder

        self.standby_message = message
        self.ender = SequenceEnder(args, token=None)

    def execute(self, requests: list) -> list:
        if self.serving is None:
            for request in requests:
                self.ender.refused(request)
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
