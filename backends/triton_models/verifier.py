"""`verifier` model: the target model behind Triton's sequence batcher (`verifier_serving.py`),
or, while the orchestrators that name it verify in their own process (`verifier_in_process`),
standing by. Standing by imports neither torch nor the target's code: its stub would load them
beside `speculative`'s own load, on the same cores, for nothing (~2 s of a 2-core server's
start, and the stub's memory)."""

from __future__ import annotations

import logging

from backends.triton_models.common import ServingOrStandingBy, initialize_model, model_repository
from backends.triton_models.pbtxt import verified_in_process

log = logging.getLogger("tritonspec.verifier")


def gpu_count() -> int:
    """The GPUs torch sees, counted as `speculative` counts them for the same decision (not
    device.cuda_device_count, which reads 0 where CUDA is unusable: the two models must agree on
    who verifies). Imports torch: asked only for a GPU instance group without `gpus`."""
    import torch

    return torch.cuda.device_count()


class TritonPythonModel(ServingOrStandingBy):
    def initialize(self, args: dict) -> None:
        settings = initialize_model(args)
        callers = verified_in_process(model_repository(args), args["model_name"], gpu_count)
        if callers:
            where = ", ".join(f"`{name}`" for name in callers)
            log.info("verifier standing by: the target is verified in the process of %s (verifier_in_process)", where)
            self.standby_message = (
                f"verifier: standing by, the target is verified in the process of {where} "
                "(verifier_in_process); send generation requests to `speculative`"
            )
            return
        from backends.triton_models.verifier_serving import VerifierModel

        self.serving = VerifierModel(args, settings)
