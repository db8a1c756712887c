"""Who verifies and who drafts for each orchestrator of a model repository, and in which
process: the placement plan.

A repository holds orchestrators (a model whose config names its verifier,
`verifier_model_name`, or says where it verifies, `verifier_in_process`: the shipped
`speculative` sets both) and the verifiers and drafters they name. Each orchestrator verifies

- in its own process (`VerifyAt.IN_PROCESS`): it loads the verifier's target itself, as the
  verifier's config.pbtxt describes it, when its `verifier_in_process` is "true", or "auto"
  (the default) with its steps batched, the verifier one instance and named by no other
  orchestrator (two would each load a copy; they share the verifier model instead);
- else over BLS, concurrent sequences' steps in one request (`VerifyAt.BATCHED`), or one request
  a step (`VerifyAt.PER_STEP`: `batch_verify_steps` "false", or a verifier of several instances,
  whose sequences' caches a batch cannot address);

and drafts, with `drafter_in_process` on (the default),

- in its own process (`DraftAt.IN_PROCESS`) with a method that drafts from token ids alone
  (IN_ORCHESTRATOR_METHODS: ngram, suffix);
- beside its in-process verifier, on the verify thread (`DraftAt.BESIDE_VERIFIER`), with one of
  this project's heads (BESIDE_VERIFIER_METHODS);

else over BLS (`DraftAt.BLS`), or not at all (`DraftAt.NONE`: it names no drafter, or that
drafter's config does not resolve).

A verifier or drafter stands by when every orchestrator naming it does its work in its own
process (a head beside the verifier included), and serves otherwise. Standing by, a drafter
loads neither torch nor its head: a second copy would cost a process's start-up and the head's
memory, for a fallback that would fail as the orchestrator's own build did (same config, same
device).

The `speculative`, `verifier` and `drafter` models each read the same plan from the same files
with the same rules, so they cannot disagree on who loads what. It is pure: config texts and a
GPU count in, answers out (tests/unit/test_topology.py). Each answer is worked out when first
asked for, so a model standing by counts GPUs (which imports torch) or resolves a drafter's
config only where its own decision needs them.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from backends.config import BESIDE_VERIFIER_METHODS, IN_ORCHESTRATOR_METHODS, SpeculativeConfig
from backends.runtime.model_store import model_context_window
from backends.triton_models.pbtxt import ModelSettings, model_settings, parameters, single_instance

VERIFIER_IN_PROCESS_CHOICES = ("auto", "true", "false")
DEFAULT_VERIFIER = "verifier"


class VerifyAt(enum.Enum):
    """Where an orchestrator's verify steps run."""

    IN_PROCESS = "in its own process"
    BATCHED = "in the verifier model, concurrent sequences' steps in one request"
    PER_STEP = "in the verifier model, one request a step"


class DraftAt(enum.Enum):
    """Where an orchestrator's drafts are made."""

    NONE = "nowhere (plain decoding)"
    IN_PROCESS = "in its own process"
    BESIDE_VERIFIER = "in its own process, beside the verifier"
    BLS = "in the drafter model"


class PlacementError(ValueError):
    """An orchestrator's placement parameter set to none of its values."""


@dataclass(frozen=True)
class Route:
    """Where one orchestrator's verify steps and drafts go."""

    verifier: str
    verify_at: VerifyAt
    why: str  # why the verify steps go there, for the load's log
    drafter: str  # "" when it names none
    draft_at: DraftAt


def gpu_count() -> int:
    """The GPUs torch sees (not device.cuda_device_count, which reads 0 where CUDA is unusable:
    every model counts them so). Imports torch: asked only for a GPU instance group without
    `gpus`."""
    import torch

    return torch.cuda.device_count()


def drafter_config(settings: ModelSettings) -> SpeculativeConfig:
    """A drafter model's `speculative_config`, resolved against its own `model`: what its load
    resolves (SpeculativeConfigError, ModelNotFoundError, ... saying why it does not)."""
    target = settings.target
    return SpeculativeConfig.from_json(
        settings.params.get("speculative_config", ""),
        target_model=str(target),
        target_max_model_len=model_context_window(target, settings.max_model_len),
    )


class Placement:
    """The placement plan of one model repository (see the module's doc)."""

    def __init__(
        self,
        configs: Mapping[str, str],
        num_gpus: int | Callable[[], int] = gpu_count,
        drafter_methods: Mapping[str, str | None] | None = None,
    ) -> None:
        """`configs`: each model's config.pbtxt text, by model name; `num_gpus`: the GPUs here,
        or a function counting them (called once, if at all); `drafter_methods`: the resolved
        method of drafters whose config the caller already resolved (None: it does not
        resolve), the others' resolved from their config when needed (`drafter_config`)."""
        self.configs = dict(configs)
        self.params = {name: parameters(text) for name, text in self.configs.items()}
        self.orchestrators = tuple(
            name for name, p in self.params.items() if "verifier_model_name" in p or "verifier_in_process" in p
        )
        self.num_gpus = functools.cache(num_gpus) if callable(num_gpus) else num_gpus
        self.methods = dict(drafter_methods or {})
        # Whether an orchestrator verifies in its own process: asked by most answers, worked out once.
        self.verifying_here = functools.cache(self._verifies_here)

    @classmethod
    def read(cls, repository: Path, **kwargs) -> Placement:
        """The plan of the repository at `repository` (its */config.pbtxt; one that cannot be
        read is left out, as if its model were not there)."""
        configs = {}
        for path in sorted(repository.glob("*/config.pbtxt")):
            try:
                configs[path.parent.name] = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
        return cls(configs, **kwargs)

    def route(self, orchestrator: str) -> Route:
        """Where `orchestrator` verifies and drafts; PlacementError naming the parameter when one
        of its placement parameters is none of its values (the others read it as "off")."""
        params = self.params.get(orchestrator, {})
        check_choice(params, "verifier_in_process", VERIFIER_IN_PROCESS_CHOICES)
        for flag in ("drafter_in_process", "batch_verify_steps"):
            check_choice(params, flag, ("true", "false"))
        verify_at, why = self._verification(orchestrator)
        drafter, draft_at = self.drafter_of(orchestrator), self.drafting(orchestrator)
        return Route(self.verifier_of(orchestrator), verify_at, why, drafter, draft_at)

    def called_over_bls(self) -> dict[str, tuple[str, ...]]:
        """{orchestrator: the models its requests call over BLS}, for each that calls one: a stop
        lets those requests end before tritonserver unloads these models (client/cli/tritonserver.py).
        An orchestrator whose placement parameter is none of its values fails its load: left out."""
        called = {}
        for orchestrator in self.orchestrators:
            try:
                route = self.route(orchestrator)
            except PlacementError:
                continue
            peers = (route.verifier,) if route.verify_at is not VerifyAt.IN_PROCESS else ()
            peers += (route.drafter,) if route.draft_at is DraftAt.BLS else ()
            if peers:
                called[orchestrator] = peers
        return called

    def stands_by_for(self, model: str) -> tuple[str, ...]:
        """The orchestrators that do `model`'s work (verify with it, or draft with it) in their own
        process, when every orchestrator naming it does: `model` then stands by. () when it
        serves: some orchestrator calls it, or none names it."""
        verifying = [o for o in self.orchestrators if self.verifier_of(o) == model]
        if verifying:
            return tuple(verifying) if all(self.verifying_here(o) for o in verifying) else ()
        drafting = [o for o in self.orchestrators if self.drafter_of(o) == model]
        here = (DraftAt.IN_PROCESS, DraftAt.BESIDE_VERIFIER)
        return tuple(drafting) if drafting and all(self.drafting(o) in here for o in drafting) else ()

    def verifier_of(self, orchestrator: str) -> str:
        return self.params.get(orchestrator, {}).get("verifier_model_name", DEFAULT_VERIFIER)

    def drafter_of(self, orchestrator: str) -> str:
        return self.params.get(orchestrator, {}).get("drafter_model_name", "")

    def drafting(self, orchestrator: str) -> DraftAt:
        """Where `orchestrator`'s drafts are made (the module's doc)."""
        drafter = self.drafter_of(orchestrator)
        method = self._method(drafter) if drafter else None
        if method is None:
            return DraftAt.NONE
        if _choice(self.params.get(orchestrator, {}), "drafter_in_process", "true") != "true":
            return DraftAt.BLS
        if method in IN_ORCHESTRATOR_METHODS:
            return DraftAt.IN_PROCESS
        if method in BESIDE_VERIFIER_METHODS and self.verifying_here(orchestrator):
            return DraftAt.BESIDE_VERIFIER
        return DraftAt.BLS

    def _verifies_here(self, orchestrator: str) -> bool:
        params = self.params.get(orchestrator, {})
        choice = _choice(params, "verifier_in_process", "auto")
        if choice != "auto":
            return choice == "true"
        verifier = self.verifier_of(orchestrator)
        if _choice(params, "batch_verify_steps", "true") == "false":
            return False
        if any(self.verifier_of(other) == verifier for other in self.orchestrators if other != orchestrator):
            return False
        text = self.configs.get(verifier)
        return text is not None and single_instance(text, self.num_gpus)

    def _verification(self, orchestrator: str) -> tuple[VerifyAt, str]:
        params = self.params.get(orchestrator, {})
        verifier = self.verifier_of(orchestrator)
        if self.verifying_here(orchestrator):
            if _choice(params, "verifier_in_process", "auto") == "true":
                return VerifyAt.IN_PROCESS, 'verifier_in_process "true"'
            return (
                VerifyAt.IN_PROCESS,
                'verifier_in_process "auto": steps batched, one verifier instance, no other caller',
            )
        if _choice(params, "batch_verify_steps", "true") == "false":
            return VerifyAt.PER_STEP, 'batch_verify_steps "false"'
        text = self.configs.get(verifier)
        if text is None:
            return VerifyAt.PER_STEP, f"the model repository has no readable config of {verifier!r}"
        if not single_instance(text, self.num_gpus):
            return VerifyAt.PER_STEP, f"{verifier!r} has several instances, and a batch cannot address them all"
        return VerifyAt.BATCHED, 'batch_verify_steps "true", one verifier instance'

    def _method(self, drafter: str) -> str | None:
        if drafter not in self.methods:
            try:
                self.methods[drafter] = drafter_config(model_settings(self.params[drafter])).method
            except Exception:  # no config, or one that does not resolve: the drafter's load says why
                self.methods[drafter] = None
        return self.methods[drafter]


def _choice(params: dict[str, str], name: str, default: str) -> str:
    return params.get(name, "").strip().lower() or default


def check_choice(params: dict[str, str], name: str, choices: tuple[str, ...]) -> None:
    """PlacementError naming parameter `name` when it is set to none of `choices`."""
    if _choice(params, name, choices[0]) in choices:
        return
    if choices == ("true", "false"):
        raise PlacementError(f'parameter {name} must be "true" or "false", got {params[name]!r}')
    raise PlacementError(f"parameter {name} must be one of {', '.join(choices)}, got {params[name]!r}")
