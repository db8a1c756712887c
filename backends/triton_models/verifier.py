"""`verifier` model: the target model behind Triton's sequence batcher (`verifier_serving.py`),
or, while the orchestrators that name it verify in their own process (`verifier_in_process`;
the placement plan of topology.py says so), standing by. Standing by imports neither torch nor the target's code: its stub would load them
beside `speculative`'s own load, on the same cores, for nothing (~2 s of a 2-core server's
start, and the stub's memory)."""

from __future__ import annotations

import logging

from backends.runtime.gc_heap import freeze_startup_heap
from backends.triton_models.common import ServingOrStandingBy, initialize_model, model_repository
from backends.triton_models.topology import Placement

log = logging.getLogger("tritonspec.verifier")


class TritonPythonModel(ServingOrStandingBy):
    def initialize(self, args: dict) -> None:
        settings = initialize_model(args)
        callers = Placement.read(model_repository(args)).stands_by_for(args["model_name"])
        if callers:
            where = ", ".join(f"`{name}`" for name in callers)
            log.info("verifier standing by: the target is verified in the process of %s (verifier_in_process)", where)
            self.stand_by(
                args,
                f"verifier: standing by, the target is verified in the process of {where} "
                "(verifier_in_process); send generation requests to `speculative`",
            )
            return
        from backends.triton_models.verifier_serving import VerifierModel

        self.serving = VerifierModel(args, settings)
        freeze_startup_heap(args["model_name"])  # a forward paused by a full collection stalls every sequence
