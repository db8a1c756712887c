"""What the `verifier` and `drafter` models share: Triton's sequence batcher hands
`execute` requests from many sequences at once (one per sequence, keyed by correlation id).

Per request: a sequence END releases that sequence's state; anything else is parsed into a
call (a malformed request fails alone); the calls run as one batch and each request gets
its own result or its own error; a failed sequence is released. A request may also carry
the steps of many sequences (the verifier's batches, step_batch.py): its rows join the same
batch and its response answers each row with its own result or error. Sequences idle for
`sequence_idle_timeout_s` are released first (a client that vanished without END).

Only the `speculative` model of the same server may call these models: a request without
its token (backends/triton_models/peer_token.py) is refused and touches no state, and its
sequence is ended (sequence_end.py), so that it holds no sequence slot of Triton's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any, Protocol

from backends.serving.idle import IdleClock
from backends.triton_models.common import SEQUENCE_END, ActiveSequencesGauge, error_response
from backends.triton_models.peer_token import has_token, server_token
from backends.triton_models.sequence_end import SequenceEnder
from backends.triton_models.step_batch import Release


class SequenceState(Protocol):
    """What holds a model's per-sequence state (the verifier's TargetRunner, the drafter's
    DraftService): it measures idleness on `clock`, which the model sets."""

    clock: Callable[[], float]

    def release(self, seq_id: int) -> object: ...

    def release_idle(self, idle_s: float, keep: Collection[int]) -> object: ...


class SequenceBatchedModel:
    role = ""  # "verifier" / "drafter": the prefix of this model's error messages and logger

    @property
    def log(self) -> logging.Logger:
        return logging.getLogger(f"tritonspec.{self.role}")

    def init_sequences(self, args: dict, params: dict[str, str], state: SequenceState) -> None:
        self.idle_s = float(params.get("sequence_idle_timeout_s", "60"))
        self.clock = IdleClock()
        self.state = state
        state.clock = self.clock
        self.active = ActiveSequencesGauge(args["model_name"])
        self.token = server_token()
        self.ender = SequenceEnder(args, self.token)

    def release(self, seq_id: int) -> None:
        self.state.release(seq_id)

    def release_idle(self, idle_s: float, keep: set[int]) -> None:
        """Release sequences idle for `idle_s` on self.clock, except those in `keep`."""
        self.state.release_idle(idle_s, keep)

    # -- what a subclass provides -------------------------------------------------------
    def parse(self, request: Any) -> Any:
        """One request -> the call it asks for; raise to refuse it (alone)."""
        raise NotImplementedError

    def run(self, calls: list) -> list:
        """The batch's results, one per call: a result or that call's own exception."""
        raise NotImplementedError

    def respond(self, result: Any) -> Any:
        raise NotImplementedError

    @property
    def num_sequences(self) -> int:
        raise NotImplementedError

    def carried(self, request: Any) -> list | None:
        """The rows of a request that carries many sequences' steps (backends/triton_models/
        step_batch.py), each a call or a Release; None for a one-sequence request. Raise to
        refuse a malformed one (alone)."""
        return None

    def respond_rows(self, results: list) -> Any:
        """The response to a carrying request: per row its result, its exception, or None (a release)."""
        raise NotImplementedError

    # -- the shared loop ----------------------------------------------------------------
    def execute(self, requests: list) -> list:
        self.clock.busy()
        try:
            return self._execute(requests)
        finally:
            self.clock.idle()

    def _execute(self, requests: list) -> list:
        responses: list = [None] * len(requests)
        accepted, stepping = self._accept(requests, responses)
        # A sequence with a step in this batch is not idle, however long the step waited.
        self.release_idle(self.idle_s, stepping)
        calls, owners, row_results = self._calls(requests, accepted, responses)
        if calls:
            self._run_calls(requests, calls, owners, responses, row_results)
        for i, results in row_results.items():
            responses[i] = self.respond_rows(results)
        self.active.set(self.num_sequences)
        return responses

    def _accept(self, requests: list, responses: list) -> tuple[list[tuple[int, list | None]], set[int]]:
        """The requests from our orchestrator with their rows (None: a single step), and the
        sequences they step; the others get their error response here."""
        accepted: list[tuple[int, list | None]] = []  # (request index, its rows or None)
        stepping: set[int] = set()
        for i, request in enumerate(requests):
            if not has_token(request.parameters(), self.token):
                # Not from our orchestrator: refused without touching any sequence's state.
                self.log.warning(
                    "refused a request for sequence %d without the internal token", request.correlation_id()
                )
                responses[i] = error_response(
                    f"{self.role}: this model only serves the `speculative` model of this server (the request "
                    "lacks its internal token); send generation requests to `speculative`"
                )
                self.ender.refused(request)
                continue
            try:
                rows = self.carried(request)
            except Exception as e:  # a malformed batch fails alone
                responses[i] = error_response(f"{self.role}: malformed batch of steps: {e}")
                continue
            stepping |= {request.correlation_id()} if rows is None else {row.seq_id for row in rows}
            accepted.append((i, rows))
        return accepted, stepping

    def _calls(
        self, requests: list, accepted: list[tuple[int, list | None]], responses: list
    ) -> tuple[list, list[tuple[int, int | None]], dict[int, list]]:
        """The calls to run, who owns each (request index, row index or None), and a result slot
        per carried row; releases and ends are done here."""
        calls: list = []
        owners: list[tuple[int, int | None]] = []  # per call: (request index, row index or None)
        row_results: dict[int, list] = {}
        for i, rows in accepted:
            request = requests[i]
            if rows is None:
                if request.flags() & SEQUENCE_END:
                    self.release(request.correlation_id())
                    responses[i] = self.respond(None)
                    continue
                try:
                    calls.append(self.parse(request))
                    owners.append((i, None))
                except Exception as e:  # a malformed request fails alone
                    responses[i] = self.fail(request.correlation_id(), e)
                continue
            row_results[i] = [None] * len(rows)
            for j, row in enumerate(rows):
                if isinstance(row, Release):
                    self.release(row.seq_id)
                else:
                    calls.append(row)
                    owners.append((i, j))
        return calls, owners, row_results

    def _run_calls(
        self,
        requests: list,
        calls: list,
        owners: list[tuple[int, int | None]],
        responses: list,
        row_results: dict[int, list],
    ) -> None:
        """Run the calls in one batch; a failed call fails its request or row alone."""
        for call, (i, j), result in zip(calls, owners, self.run(calls)):
            if j is None:
                seq_id = requests[i].correlation_id()
                responses[i] = self.fail(seq_id, result) if isinstance(result, Exception) else self.respond(result)
            elif isinstance(result, Exception):
                self.end_failed(call.seq_id, result)
                row_results[i][j] = RuntimeError(f"{self.role}: {result}")
            else:
                row_results[i][j] = result

    def end_failed(self, seq_id: int, error: Exception) -> None:
        # The step fails; the server and the other sequences don't.
        self.log.warning("sequence %d: %s", seq_id, error)
        self.release(seq_id)

    def fail(self, seq_id: int, error: Exception) -> Any:
        self.end_failed(seq_id, error)
        return error_response(f"{self.role}: {error}")
