"""The speculative config: vLLM's ``--speculative-config`` parsed, validated and resolved
(:mod:`.speculative`, with the fields' checks in :mod:`.fields`, the combinations' in
:mod:`.verify` and auto-detection in :mod:`.detect`), and the small resolved
config a proposer takes (:mod:`.drafter`)."""

from backends.config.detect import (
    MTP_MODEL_TYPES,
    MULTI_STEP_MTP_TYPES,
    aux_layer_ids,
    hf_config_override,
    speculators_draft_config,
)
from backends.config.drafter import DrafterConfig
from backends.config.errors import SpeculativeConfigError, UnsupportedSpeculativeMethodError
from backends.config.fields import METHODS
from backends.config.speculative import (
    BESIDE_VERIFIER_METHODS,
    IN_ORCHESTRATOR_METHODS,
    NO_EFFECT_FIELDS,
    SpeculativeConfig,
)

__all__ = [
    "BESIDE_VERIFIER_METHODS",
    "IN_ORCHESTRATOR_METHODS",
    "METHODS",
    "MTP_MODEL_TYPES",
    "MULTI_STEP_MTP_TYPES",
    "NO_EFFECT_FIELDS",
    "DrafterConfig",
    "SpeculativeConfig",
    "SpeculativeConfigError",
    "UnsupportedSpeculativeMethodError",
    "aux_layer_ids",
    "hf_config_override",
    "speculators_draft_config",
]
