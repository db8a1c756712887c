"""`drafter` model: the proposer that the `speculative_config` parameter names
(`drafter_serving.py`), or, while the orchestrators that name it draft in their own process
(a method that drafts from token ids alone, `drafter_in_process`; the placement plan of
topology.py says so), standing by. Either way its load parses the config, so a bad one fails
this model's load with the config's own message.
Standing by imports neither torch nor transformers: its stub would load them beside
`speculative`'s own load, on the same cores, for nothing (the shipped ngram repository's case)."""

from __future__ import annotations

import logging

from backends.runtime.gc_heap import freeze_startup_heap
from backends.runtime.model_store import model_context_window
from backends.triton_models.common import ServingOrStandingBy, initialize_model, model_repository
from backends.triton_models.topology import Placement, drafter_config

log = logging.getLogger("tritonspec.drafter")


class TritonPythonModel(ServingOrStandingBy):
    def initialize(self, args: dict) -> None:
        settings = initialize_model(args)
        config = drafter_config(settings)  # as the placement plan resolves it
        name = args["model_name"]
        plan = Placement.read(model_repository(args), drafter_methods={name: config.method})
        callers = plan.stands_by_for(name)
        if callers:
            where = ", ".join(f"`{caller}`" for caller in callers)
            log.info("drafter standing by: %s drafts in the process of %s (drafter_in_process)", config.method, where)
            self.stand_by(
                args,
                f"drafter: standing by, drafting runs in the process of {where} "
                "(drafter_in_process); send generation requests to `speculative`",
            )
            return
        from backends.triton_models.drafter_serving import DrafterModel

        max_len = model_context_window(settings.target, settings.max_model_len)
        self.serving = DrafterModel(args, settings, config, max_len)
        freeze_startup_heap(name)  # a forward paused by a full collection stalls every sequence
