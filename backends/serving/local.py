"""Speculative decoding in process, without Triton: the verifier and drafter roles played by
a TargetRunner and a DraftService directly, driven by the same `generate` loop the server
runs. For debugging a method, for the runtime's benchmarks, and for the loop tests.

    runner = TargetRunner(model_path, dtype="float32")
    service = DraftService(build_proposer(config, max_model_len=runner.max_model_len), config)
    ids, stats = generate_local("def add(a, b):", tokenizer, runner, service, max_tokens=32)
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from backends.config import DrafterConfig
from backends.serving.detokenize import TextStream
from backends.serving.drafting import DraftCall, DraftService
from backends.serving.orchestrator import Generation, GenerationStats, ServingContext, generate
from backends.serving.proposer import Draft, DrafterInfo
from backends.serving.request import GenerationRequest
from backends.serving.target import TargetRunner, VerifyRequest, VerifyResult

if TYPE_CHECKING:
    from backends.structured.grammar import GrammarCompiler


class LocalVerifier:
    """The orchestrator's Verifier over a TargetRunner in this process."""

    def __init__(self, runner: TargetRunner) -> None:
        self.runner = runner

    def verify(self, req: VerifyRequest) -> VerifyResult:
        return self.runner.verify(req)

    def release(self, seq_id: int) -> None:
        self.runner.release(seq_id)


def drafter_info(service: DraftService) -> DrafterInfo:
    """What the orchestrator knows of a drafter it calls in process."""
    proposer = service.proposer
    return DrafterInfo(
        DrafterConfig.from_speculative(service.config),
        tuple(proposer.hidden_layer_ids),
        proposer.proposes_drafts,
        proposer.in_orchestrator,
        proposer.beside_verifier,
    )


class LocalDrafter:
    """The orchestrator's Drafter over a DraftService in this process; the `speculative`
    model's request threads share one (drafter_in_process), so calls take turns.
    `report_sequences`, if given, is told how many sequences the service holds after each call
    (the drafter model's active-sequences metric, when it stands by)."""

    def __init__(self, service: DraftService, report_sequences: Callable[[int], None] | None = None) -> None:
        self.service = service
        self.info = drafter_info(service)
        self.lock = threading.Lock()
        self.report_sequences = report_sequences

    def draft(self, call: DraftCall) -> tuple[Draft, float]:
        with self.lock:
            start = time.perf_counter()
            draft = self.service.draft([call])[0], time.perf_counter() - start
            self._report()
            return draft

    def release(self, seq_id: int) -> None:
        with self.lock:
            self.service.release(seq_id)
            self._report()

    def _report(self) -> None:
        if self.report_sequences is not None:
            self.report_sequences(self.service.num_sequences)


def generate_local(
    prompt: str,
    tokenizer: Any,
    runner: TargetRunner,
    service: DraftService | None = None,
    eos_token_ids: set[int] | None = None,
    adaptive: bool = False,
    prefill_chunk: int = 0,
    grammars: GrammarCompiler | None = None,
    **request: Any,
) -> tuple[list[int], GenerationStats]:
    """One request through the draft -> verify loop: its output ids and statistics.
    `request`: GenerationRequest fields (max_tokens, num_draft_tokens, sampling, stop, ...);
    `service` None decodes plainly. A fixed k by default (adaptive k follows timings).
    `prefill_chunk`: the prompt goes to the target in chunks of this many tokens (0: at once).
    `grammars`: compiles a `structured` request's constraint (none: such a request is refused)."""
    req = GenerationRequest(prompt=prompt, **request)
    drafter = LocalDrafter(service) if service else None
    extract = drafter.info.hidden_layer_ids if drafter and not drafter.info.proposes_drafts else ()
    if eos_token_ids is None:
        eos_token_ids = {tokenizer.eos_token_id} - {None}
    ctx = ServingContext(
        eos_token_ids, runner.max_model_len, adaptive, extract, prefill_chunk=prefill_chunk, grammars=grammars
    )
    seq_id, ids = random.getrandbits(63), []
    text = TextStream(tokenizer, req.stop)
    try:
        gen = Generation(req, tokenizer(prompt)["input_ids"], seq_id, LocalVerifier(runner), drafter, text, ctx)
        for step in generate(gen):
            ids += step.token_ids
    finally:
        runner.release(seq_id)
        if service:
            service.release(seq_id)
    return ids, gen.stats
