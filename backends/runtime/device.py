"""Where a Triton model's weights and per-sequence state live: one rule for the verifier and
the drafter.

In order, the first that is set decides:
1. the model's `device` parameter in config.pbtxt,
2. the `TRITONSPEC_DEVICE` environment variable (what a container sets for every model),
3. the model instance's kind (`instance_group`): KIND_GPU -> `cuda:<the instance's GPU>`,
   KIND_CPU -> `cpu`, anything else (KIND_AUTO, KIND_MODEL) -> CUDA when torch has it.

A setting is `auto` (CUDA when torch has it, else CPU), `cpu`, `cuda` (the instance's GPU)
or `cuda:N`. A GPU that is asked for but cannot be used (a CPU-only torch build, no such
device) is a load error saying so, never a silent fallback to the CPU.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

ENV_VAR = "TRITONSPEC_DEVICE"
SETTINGS = ("auto", "cpu", "cuda", "cuda:N")


class DeviceError(ValueError):
    """A device that is malformed or cannot be used in this process."""


def cuda_device_count() -> int:
    """CUDA devices torch can use here (0 with a CPU-only build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def keep_attention_off_cudnn(device: str | torch.device) -> None:
    """For a transformers model on a GPU: torch's SDPA sends a masked attention to cuDNN first
    on Hopper and newer, and cuDNN builds an execution plan for every new shape, which decoding
    makes every step (the key length grows). On an H200 a 170M-parameter verify step through
    transformers took 42-60 ms against under 9 ms in a profile that replayed shapes already
    planned. Flash and memory-efficient attention need no plan. Process-wide, as torch's
    backend switches are."""
    if torch.device(device).type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("cuDNN attention off for transformers' SDPA on %s: it plans again for every new shape", device)


def resolve_device(
    instance_kind: str = "",
    device_id: int | str = 0,
    parameter: str = "",
    environment: str | None = None,
    num_cuda: int | None = None,
) -> tuple[str, str]:
    """(device, why): the torch device string for a model instance, and which setting chose
    it. `instance_kind` and `device_id` are the Python backend's `model_instance_kind` ("CPU",
    "GPU", ...) and `model_instance_device_id`; `environment` defaults to $TRITONSPEC_DEVICE
    and `num_cuda` to what torch sees (both given by tests)."""
    environment = os.environ.get(ENV_VAR, "") if environment is None else environment
    num_cuda = cuda_device_count() if num_cuda is None else num_cuda
    gpu = int(device_id or 0)
    for source, setting in (
        (f"parameter device={parameter!r}", parameter),
        (f"{ENV_VAR}={environment!r}", environment),
    ):
        if setting.strip():
            return _from_setting(setting.strip().lower(), gpu, num_cuda, source), source
    kind = (instance_kind or "").upper().removeprefix("KIND_")
    source = f"instance_group KIND_{kind or 'AUTO'}"
    if kind == "CPU":
        return "cpu", source
    if kind == "GPU":
        return _cuda(gpu, num_cuda, source), f"{source}, GPU {gpu}"
    return (f"cuda:{gpu}" if num_cuda > gpu else "cpu"), source


def _from_setting(setting: str, gpu: int, num_cuda: int, source: str) -> str:
    if setting == "auto":
        return f"cuda:{gpu}" if num_cuda > gpu else "cpu"
    if setting == "cpu":
        return "cpu"
    if setting == "cuda":
        return _cuda(gpu, num_cuda, source)
    index = setting.removeprefix("cuda:")
    if setting.startswith("cuda:") and index.isdigit():
        return _cuda(int(index), num_cuda, source)
    raise DeviceError(f"{source}: not a device; use one of {', '.join(SETTINGS)}")


def _cuda(index: int, num_cuda: int, source: str) -> str:
    if num_cuda == 0:
        raise DeviceError(
            f"{source} asks for a GPU, but torch {torch.__version__} in this Python has no CUDA device "
            "(a CPU-only build, or no GPU visible); install a CUDA build of torch, or use KIND_CPU / "
            "device=cpu"
        )
    if index >= num_cuda:
        raise DeviceError(f"{source} asks for cuda:{index}, but torch sees {num_cuda} CUDA device(s)")
    return f"cuda:{index}"
