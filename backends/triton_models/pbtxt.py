"""Reading and writing string `parameters` of a config.pbtxt text (what the launcher patches
and what the orchestrator reads of its drafter's and verifier's entries at load)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from backends.config import IN_ORCHESTRATOR_METHODS


def set_parameter(pbtxt: str, key: str, value: str) -> str:
    """Set (or add) a string parameter in a config.pbtxt text."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    line = f'parameters: {{ key: "{key}" value: {{ string_value: "{escaped}" }} }}'
    pattern = re.compile(r'^parameters:\s*\{\s*key:\s*"' + re.escape(key) + r'".*$', re.M)
    if pattern.search(pbtxt):
        return pattern.sub(lambda _: line, pbtxt, count=1)
    return pbtxt.rstrip("\n") + "\n" + line + "\n"


def get_parameter(pbtxt: str, key: str) -> str | None:
    return parameters(pbtxt).get(key)


def single_instance(pbtxt: str, num_gpus: int | Callable[[], int]) -> bool:
    """Whether the config's instance_group makes exactly one instance (on a host with
    `num_gpus` GPUs: a KIND_GPU group without `gpus` makes one per GPU). `num_gpus` may be a
    function giving the count, called only for such a group (counting GPUs imports torch)."""
    groups = re.findall(r"\{[^{}]*\bkind:\s*KIND_([A-Z]+)[^{}]*\}", pbtxt)
    if len(groups) != 1:
        return False
    group = re.search(r"\{[^{}]*\bkind:\s*KIND_[A-Z]+[^{}]*\}", pbtxt).group(0)
    count = re.search(r"\bcount:\s*(\d+)", group)
    gpus = re.search(r"\bgpus:\s*\[([^\]]*)\]", group)
    per_device = 1 if count is None else int(count.group(1))
    if groups[0] != "GPU":
        return per_device == 1
    if gpus:
        devices = len([g for g in gpus.group(1).split(",") if g.strip()])
    else:
        devices = num_gpus() if callable(num_gpus) else num_gpus
    return per_device * devices == 1


def parameters(pbtxt: str) -> dict[str, str]:
    """All string `parameters` of a config.pbtxt text."""
    found = re.findall(r'key:\s*"((?:[^"\\]|\\.)*)"\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"', pbtxt)
    values: dict[str, str] = {}
    for key, value in found:  # the first of a repeated key, as Triton reads it
        values.setdefault(key, value.replace('\\"', '"').replace("\\\\", "\\"))
    return values


def instance_group(pbtxt: str) -> tuple[str, int]:
    """The first instance group's kind ("KIND_CPU", "KIND_GPU", ...; "" when none) and its
    first GPU (0 when it names none)."""
    group = re.search(r"\{[^{}]*\bkind:\s*(KIND_[A-Z]+)[^{}]*\}", pbtxt)
    if group is None:
        return "", 0
    gpus = re.search(r"\bgpus:\s*\[\s*(\d+)", group.group(0))
    return group.group(1), int(gpus.group(1)) if gpus else 0


IN_PROCESS_CHOICES = ("auto", "true", "false")


def in_process_choice(params: dict[str, str]) -> str:
    """An orchestrator's `verifier_in_process` ("auto" when unset); ValueError naming the
    parameter when it is none of IN_PROCESS_CHOICES."""
    choice = params.get("verifier_in_process", "auto").strip().lower() or "auto"
    if choice not in IN_PROCESS_CHOICES:
        raise ValueError(
            f"parameter verifier_in_process must be one of {', '.join(IN_PROCESS_CHOICES)}, "
            f"got {params['verifier_in_process']!r}"
        )
    return choice


def _orchestrators(repository: Path) -> dict[str, dict[str, str]]:
    """The parameters of each orchestrator of `repository` (a model that sets
    `verifier_model_name` or `verifier_in_process`), by model name."""
    found = {}
    for config in sorted(repository.glob("*/config.pbtxt")):
        params = parameters(config.read_text())
        if "verifier_model_name" in params or "verifier_in_process" in params:
            found[config.parent.name] = params
    return found


def drafted_in_process(repository: Path, drafter_name: str, method: str) -> tuple[str, ...]:
    """The orchestrators of `repository` that draft in their own process what drafter
    `drafter_name` would (its `method` drafts from token ids alone, IN_ORCHESTRATOR_METHODS, and
    their `drafter_in_process` is on, the default), when every orchestrator naming that drafter
    does; () when none names it or one calls it (then it must load). A value of
    `drafter_in_process` other than "true"/"false" reads as "false" here; the orchestrator's own
    load refuses it by name."""
    if method not in IN_ORCHESTRATOR_METHODS:
        return ()
    callers = {
        name: params.get("drafter_in_process", "").strip().lower() or "true"
        for name, params in _orchestrators(repository).items()
        if params.get("drafter_model_name", "") == drafter_name
    }
    if not callers or any(flag != "true" for flag in callers.values()):
        return ()
    return tuple(callers)


def verifies_in_process(repository: Path, orchestrator: str, num_gpus: int | Callable[[], int]) -> bool:
    """Whether orchestrator `orchestrator` of `repository` loads its verifier's target and
    verifies in its own process: its `verifier_in_process` is "true", or "auto" (the default)
    and its steps are batched (`batch_verify_steps` not "false"), its verifier has one instance
    and no other orchestrator names that verifier (they share it over BLS instead of each
    loading a copy). A value other than the three choices reads as "false" here; the
    orchestrator's own load refuses it by name (in_process_choice)."""
    return _verifies_in_process(repository, _orchestrators(repository), orchestrator, num_gpus)


def _verifies_in_process(
    repository: Path, orchestrators: dict[str, dict[str, str]], orchestrator: str, num_gpus: int | Callable[[], int]
) -> bool:
    params = orchestrators.get(orchestrator, {})
    try:
        choice = in_process_choice(params)
    except ValueError:
        return False
    if choice != "auto":
        return choice == "true"
    verifier = params.get("verifier_model_name", "verifier")
    if params.get("batch_verify_steps", "true").strip().lower() == "false":
        return False
    if any(p.get("verifier_model_name", "verifier") == verifier for n, p in orchestrators.items() if n != orchestrator):
        return False
    try:
        pbtxt = (repository / verifier / "config.pbtxt").read_text()
    except OSError:
        return False
    return single_instance(pbtxt, num_gpus)


def verified_in_process(repository: Path, verifier_name: str, num_gpus: int | Callable[[], int]) -> tuple[str, ...]:
    """The orchestrators of `repository` that load the target of verifier `verifier_name` and
    verify in their own process; () unless some do and none calls the verifier (then it must
    load)."""
    orchestrators = _orchestrators(repository)
    local, remote = [], []
    for name, params in orchestrators.items():
        if params.get("verifier_model_name", "verifier") != verifier_name:
            continue
        in_process = _verifies_in_process(repository, orchestrators, name, num_gpus)
        (local if in_process else remote).append(name)
    return () if remote or not local else tuple(local)
