"""`drafter` model: the proposer that the `speculative_config` parameter names
(`drafter_serving.py`), or, while the orchestrators that name it draft in their own process
(a method that drafts from token ids alone, `drafter_in_process`), standing by. Either way its
load parses the config, so a bad one fails this model's load with the config's own message.
Standing by imports neither torch nor transformers: its stub would load them beside
`speculative`'s own load, on the same cores, for nothing (the shipped ngram repository's case)."""

from __future__ import annotations

import logging

from backends.config import SpeculativeConfig
from backends.runtime.model_store import model_context_window
from backends.triton_models.common import ServingOrStandingBy, initialize_model, model_repository
from backends.triton_models.pbtxt import drafted_in_process

log = logging.getLogger("tritonspec.drafter")


class TritonPythonModel(ServingOrStandingBy):
    def initialize(self, args: dict) -> None:
        settings = initialize_model(args)
        target = settings.target
        max_len = model_context_window(target, settings.max_model_len)
        config = SpeculativeConfig.from_json(
            settings.params.get("speculative_config", ""), target_model=str(target), target_max_model_len=max_len
        )
        callers = drafted_in_process(model_repository(args), args["model_name"], config.method)
        if callers:
            where = ", ".join(f"`{name}`" for name in callers)
            log.info("drafter standing by: %s drafts in the process of %s (drafter_in_process)", config.method, where)
            self.standby_message = (
                f"drafter: standing by, drafting runs in the process of {where} "
                "(drafter_in_process); send generation requests to `speculative`"
            )
            return
        from backends.triton_models.drafter_serving import DrafterModel

        self.serving = DrafterModel(args, settings, config, max_len)
