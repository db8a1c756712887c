"""Many sequences' verify steps in one BLS request to the `verifier`.

Sent one request per sequence, the steps of concurrent sequences reach the verifier a few
milliseconds apart, and its sequence batcher runs whatever has arrived: 8 streams ran as two
cohorts of ~4 taking turns, each paying a whole forward (weight streaming makes a forward of 8
rows cost about what one of 4 does). The `StepBatcher` gathers the waiting steps of every
running sequence and sends them as one request, so they share one forward.

On the wire a batch is one single-request sequence (START | END under a fresh correlation id):
the `rows` parameter (JSON) says, row by row, which sequence a step belongs to and how many of
the concatenated `input_ids`, `draft_ids`, `draft_probs`, `draft_parents` and `token_mask` rows
(structured outputs: a constrained row's count, none for the others) are its own; the
response concatenates the rows' `output_ids` (with `output_lengths`) and per-row `forward_ms`;
only when some row has them, `hidden_states` (with `hidden_lengths`), `row_errors` ("" = no
error) and `waiting` (the row's step did not run: no KV room now, send it again). A row may instead end its sequence (`release`). Sequences that ask for logprobs keep one request per step.

With the `speculative` model's `verifier_in_process`, the batcher hands its rows to the target
in that process instead (`in_process`): no wire and no round trip, logprobs included. A head
drafter there drafts beside it (`GatheredDrafter`): a second batcher gathers the sequences'
draft calls into one propose on the same thread.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from backends.serving.drafting import DraftCall, DraftService
from backends.serving.local import drafter_info
from backends.serving.proposer import Draft
from backends.serving.request import SamplingParams
from backends.serving.target import TargetRunner, VerifyRequest, VerifyResult

log = logging.getLogger("tritonspec.verifier")
ROWS = "rows"  # the request parameter that makes a verifier request a batch of steps
ROW_INPUTS = ("input_ids", "draft_ids", "draft_probs", "draft_parents", "token_mask")  # what its rows share
BATCH_OUTPUTS = [
    "output_ids",
    "output_lengths",
    "hidden_states",
    "hidden_lengths",
    "forward_ms",
    "row_errors",
    "waiting",
]


@dataclass
class Release:
    """A row that ends its sequence in the verifier (what END does for one-sequence requests)."""

    seq_id: int


Row = VerifyRequest | Release


# -- the wire format: the orchestrator encodes, the verifier decodes ------------------------------
def encode_rows(rows: list[Row]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The inputs and parameters of one verifier request carrying `rows`."""
    meta, new_ids, draft_ids, probs, parents, masks = [], [], [], [], [], []
    for row in rows:
        if isinstance(row, Release):
            meta.append({"seq": row.seq_id, "release": True})
            continue
        entry: dict[str, Any] = {"seq": row.seq_id, "n": len(row.new_token_ids), "k": len(row.draft_token_ids)}
        if row.sampling is not None:
            entry["sampling"] = row.sampling.to_json()
        if row.max_new_tokens is not None:
            entry["max_new"] = row.max_new_tokens
        if row.prefill_only:
            entry["prefill_only"] = True
        if row.hidden_layer_ids:
            entry["layers"] = list(row.hidden_layer_ids)
        if row.draft_probs is not None:
            entry["probs"] = True
            probs.append(row.draft_probs.numpy())
        if row.draft_parents is not None:
            entry["tree"] = True
            parents += row.draft_parents
        if row.token_mask is not None:  # its own count: a wrong one fails its row alone (the runner's check)
            entry["mask"] = len(row.token_mask)
            masks.append(row.token_mask.numpy())
        meta.append(entry)
        new_ids += row.new_token_ids
        draft_ids += row.draft_token_ids
    inputs = {"input_ids": np.array([new_ids], dtype=np.int64), "draft_ids": np.array([draft_ids], dtype=np.int64)}
    if probs:
        inputs["draft_probs"] = np.concatenate(probs)[None]
    if parents:
        inputs["draft_parents"] = np.array([parents], dtype=np.int64)
    if masks:
        inputs["token_mask"] = np.concatenate(masks)[None]
    return inputs, {ROWS: json.dumps(meta)}


def decode_rows(meta_json: str, inputs: Mapping[str, np.ndarray | None]) -> list[Row]:
    """The rows of a batch request, from its `rows` parameter and its input tensors by name
    (absent or None: not sent); raises ValueError when its parts do not add up."""
    meta = json.loads(meta_json)
    if not isinstance(meta, list):
        raise ValueError("the `rows` parameter must be a JSON list")
    input_ids, draft_ids, parents = (_ids(inputs.get(name)) for name in ("input_ids", "draft_ids", "draft_parents"))
    probs, masks = (_matrix(inputs.get(name)) for name in ("draft_probs", "token_mask"))
    rows: list[Row] = []
    ids_at = drafts_at = probs_at = parents_at = masks_at = 0
    for entry in meta:
        seq_id = int(entry["seq"])
        if entry.get("release"):
            rows.append(Release(seq_id))
            continue
        n, k = int(entry["n"]), int(entry["k"])
        row_probs = row_parents = row_mask = None
        if entry.get("probs"):
            if probs is None:
                raise ValueError(f"row of sequence {seq_id} has draft probabilities but the request has none")
            row_probs, probs_at = probs[probs_at : probs_at + k], probs_at + k
        if entry.get("tree"):
            row_parents, parents_at = parents[parents_at : parents_at + k], parents_at + k
        if "mask" in entry:
            if masks is None:
                raise ValueError(f"row of sequence {seq_id} has a token mask but the request has none")
            m = int(entry["mask"])
            row_mask, masks_at = masks[masks_at : masks_at + m], masks_at + m
        sampling = entry.get("sampling")
        rows.append(
            VerifyRequest(
                seq_id,
                input_ids[ids_at : ids_at + n],
                draft_ids[drafts_at : drafts_at + k],
                SamplingParams.from_json(sampling) if sampling else None,
                tuple(entry.get("layers", ())),
                row_probs,
                entry.get("max_new"),
                row_parents,
                entry.get("prefill_only") is True,
                row_mask,
            )
        )
        ids_at, drafts_at = ids_at + n, drafts_at + k
    used = (ids_at, drafts_at, probs_at, parents_at, masks_at)
    given = tuple(0 if part is None else len(part) for part in (input_ids, draft_ids, probs, parents, masks))
    if used != given:
        raise ValueError(f"the rows use {used} of {ROW_INPUTS}, the request has {given}")
    return rows


def _ids(array: np.ndarray | None) -> list[int]:
    return [] if array is None else array.reshape(-1).tolist()


def _matrix(array: np.ndarray | None) -> torch.Tensor | None:
    """A [1, rows, columns] (or [rows, columns]) input as a [rows, columns] tensor."""
    return None if array is None else torch.from_numpy(array.reshape(-1, array.shape[-1]))


def encode_results(results: list[VerifyResult | Exception | None]) -> dict[str, np.ndarray]:
    """The outputs answering a batch request: one result, error, or None (a release) per row."""
    ids, lengths, hidden, hidden_lengths, forward_ms, errors, waiting = [], [], [], [], [], [], []
    for result in results:
        ok = isinstance(result, VerifyResult)
        waiting.append(ok and result.waiting)
        tokens = result.token_ids if ok else []
        ids += tokens
        lengths.append(len(tokens))
        rows = result.hidden_states if ok and result.hidden_states is not None else None
        hidden_lengths.append(0 if rows is None else len(rows))
        if rows is not None:
            hidden.append(rows.numpy())
        forward_ms.append(result.forward_s * 1e3 if ok else 0.0)
        errors.append(str(result).encode() if isinstance(result, Exception) else b"")
    outputs = {
        "output_ids": np.array([ids], dtype=np.int64),
        "output_lengths": np.array([lengths], dtype=np.int64),
        "forward_ms": np.array([forward_ms], dtype=np.float64),
    }
    # Only what some row has: every output tensor costs its share of the round trip.
    if any(errors):
        outputs["row_errors"] = np.array([errors], dtype=np.object_)
    if any(waiting):
        outputs["waiting"] = np.array([waiting], dtype=bool)
    if hidden:
        outputs["hidden_states"] = np.concatenate(hidden)[None]
        outputs["hidden_lengths"] = np.array([hidden_lengths], dtype=np.int64)
    return outputs


def decode_results(out: dict[str, np.ndarray], num_rows: int) -> list[VerifyResult | Exception]:
    """Each row's VerifyResult, or a RuntimeError carrying the verifier's message for it."""
    ids = out["output_ids"].reshape(-1).tolist()
    lengths = out["output_lengths"].reshape(-1).tolist()
    forward_ms = out["forward_ms"].reshape(-1).tolist()
    errors = out["row_errors"].reshape(-1).tolist() if "row_errors" in out else [""] * len(lengths)
    waiting = out["waiting"].reshape(-1).tolist() if "waiting" in out else [False] * len(lengths)
    hidden = out.get("hidden_states")
    hidden_lengths = out["hidden_lengths"].reshape(-1).tolist() if hidden is not None else [0] * len(lengths)
    if hidden is not None:
        hidden = torch.from_numpy(hidden.reshape(hidden.shape[-3:]))
    if len(lengths) != num_rows:
        raise RuntimeError(f"verifier answered {len(lengths)} rows of {num_rows}")
    results: list[VerifyResult | Exception] = []
    at = hidden_at = 0
    for n, h, ms, error, wait in zip(lengths, hidden_lengths, forward_ms, errors, waiting):
        message = error.decode() if isinstance(error, bytes) else str(error)
        if message:
            results.append(RuntimeError(message))
        elif wait:
            results.append(VerifyResult([], 0, 0.0, waiting=True))
        else:
            tokens = ids[at : at + n]
            rows = hidden[hidden_at : hidden_at + h] if hidden is not None and h else None
            results.append(VerifyResult(tokens, max(n - 1, 0), ms / 1e3, rows))
        at, hidden_at = at + n, hidden_at + h
    return results


def over_bls(send: Callable[[dict, list[str], dict], dict]) -> Callable[[list[Row]], list]:
    """A StepBatcher's run_rows that sends the rows to the verifier model as one request;
    send(inputs, outputs, parameters) -> outputs is that BLS call."""

    def run_rows(rows: list[Row]) -> list[VerifyResult | Exception]:
        inputs, parameters = encode_rows(rows)
        return decode_results(send(inputs, BATCH_OUTPUTS, parameters), len(rows))

    return run_rows


def verify_steps(runner: TargetRunner, steps: list[VerifyRequest]) -> list[VerifyResult | Exception]:
    """runner.verify_batch, where a forward that fails fails every step in it."""
    try:
        return runner.verify_batch(steps)
    except Exception as e:  # the forward itself failed: every sequence in it is suspect
        log.exception("batched verification failed")
        return [e] * len(steps)


def in_process(runner: TargetRunner, after: Callable[[list], None] = lambda steps: None) -> Callable[[list[Row]], list]:
    """A StepBatcher's run_rows that verifies with `runner` in this process (the `speculative`
    model's verifier_in_process): what the verifier model does with a batch request, releases
    first and a failed step ending its sequence, without the round trip. `after` runs after
    each batch, given its steps (the metrics the verifier model would update)."""

    def run_rows(rows: list[Row]) -> list[VerifyResult | Exception | None]:
        for row in rows:
            if isinstance(row, Release):
                runner.release(row.seq_id)
        steps = [row for row in rows if not isinstance(row, Release)]
        results = verify_steps(runner, steps) if steps else []
        answers: list[VerifyResult | Exception | None] = []
        step_results = iter(results)
        for row in rows:
            result = None if isinstance(row, Release) else next(step_results)
            if isinstance(result, Exception):  # the step fails; the other sequences don't
                log.warning("sequence %d: %s", row.seq_id, result)
                runner.release(row.seq_id)
                result = RuntimeError(f"verifier: {result}")
            answers.append(result)
        after(steps)
        return answers

    return run_rows


# -- the orchestrator's side -----------------------------------------------------------------------
class StepBatcher:
    """Gathers the verify steps of the orchestrator's running sequences into one request.

    A step waits until every running sequence has one (or a release) or until the gather window
    closes: a fraction of the last batch's round trip, at most `max_wait_s`, so a sequence that
    is still drafting or streaming delays the others by little. One batch is in flight at a time;
    steps that come meanwhile form the next. A lone sequence never waits and sends its step
    itself (a hop through the batcher's thread would cost it ~1 ms a step).
    """

    def __init__(
        self,
        run_rows: Callable[[list[Row]], list[VerifyResult | Exception | None]],
        max_wait_s: float = 0.004,
        wait_fraction: float = 0.25,
        carries_logprobs: bool = False,
    ) -> None:
        # run_rows(rows) -> per row its result, its exception or None (a release): one
        # request to the verifier model (over_bls) or the target in this process (in_process).
        self.run_rows = run_rows
        # Whether results carry logprobs (the wire does not: such sequences send their own steps).
        self.carries_logprobs = carries_logprobs
        self.max_wait_s = max_wait_s
        self.wait_fraction = wait_fraction
        self.cond = threading.Condition()
        self.running: set[int] = set()  # sequences with state in the verifier
        # Of those, the ones whose step waits for KV room: batches do not wait for their next row.
        self.waiting: set[int] = set()
        self.pending: list[tuple[Row, Future]] = []
        self.in_flight = False
        self.last_round_trip_s = 0.0
        threading.Thread(target=self._loop, name="spec-step-batcher", daemon=True).start()

    def verify(self, req: VerifyRequest) -> VerifyResult:
        result = self.submit(req)
        assert isinstance(result, VerifyResult)
        return result

    def submit(self, row: VerifyRequest | DraftCall) -> Any:
        """One sequence's row in the next batch; what run_rows answered for it."""
        return self._submit(row, start=True)

    def release(self, seq_id: int) -> None:
        with self.cond:
            if seq_id not in self.running | self.waiting:
                return
        self._submit(Release(seq_id), start=False)

    def _submit(self, row: Row | DraftCall, start: bool) -> Any:
        future: Future = Future()
        with self.cond:
            self.waiting.discard(row.seq_id)
            if start:
                self.running.add(row.seq_id)
            else:
                self.running.discard(row.seq_id)  # a release is the sequence's last row
            alone = not self.in_flight and not self.pending and self.running <= {row.seq_id}
            if alone:
                self.in_flight = True
            else:
                self.pending.append((row, future))
                self.cond.notify()
        if alone:
            self._run([(row, future)])
        return future.result()

    def _gather(self) -> list[tuple[Row, Future]]:
        with self.cond:
            while not self.pending or self.in_flight:
                self.cond.wait()
            deadline = time.monotonic() + min(self.max_wait_s, self.wait_fraction * self.last_round_trip_s)
            while (left := deadline - time.monotonic()) > 0 and self._waiting_for_more():
                self.cond.wait(left)
            batch, self.pending = self.pending, []
            self.in_flight = True
            return batch

    def _waiting_for_more(self) -> bool:
        submitted = {row.seq_id for row, _ in self.pending}
        return not self.running <= submitted

    def _loop(self) -> None:
        while True:
            self._run(self._gather())

    def _run(self, batch: list[tuple[Row, Future]]) -> None:
        """Send one batch (marked in flight by the caller) and answer each row's future."""
        rows = [row for row, _ in batch]
        start = time.perf_counter()
        try:
            results = self.run_rows(rows)
        except Exception as e:  # the whole call failed: every row gets the error
            results = [e] * len(rows)
        self.last_round_trip_s = time.perf_counter() - start
        with self.cond:
            for row, result in zip(rows, results):
                if isinstance(result, Exception):
                    self.running.discard(row.seq_id)  # the verifier ended a sequence whose step failed
                elif isinstance(result, VerifyResult) and result.waiting:  # it sends its step again later
                    self.running.discard(row.seq_id)
                    self.waiting.add(row.seq_id)
            self.in_flight = False
            if self.pending:  # the next batch can go (a lone sequence's step wakes nobody)
                self.cond.notify()
        for (row, future), result in zip(batch, results):
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(None if isinstance(row, Release) else result)


def batch_correlation_id() -> int:
    """A fresh correlation id for one batch request (a single-request sequence)."""
    return secrets.randbits(63) or 1


# -- a head drafter beside the in-process verifier ----------------------------------------------
def drafting(service: DraftService) -> Callable[[list[DraftCall | Release]], list]:
    """A StepBatcher's run_rows over a DraftService: releases first, then one propose for every
    sequence's call; each call's answer is (its drafts, the propose's seconds). A propose that
    fails fails each of its calls (those requests decode plainly from there, as after any
    drafter failure) and forgets their sequences."""

    def run_rows(rows: list[DraftCall | Release]) -> list:
        for row in rows:
            if isinstance(row, Release):
                service.release(row.seq_id)
        calls = [row for row in rows if not isinstance(row, Release)]
        start = time.perf_counter()
        try:
            drafts: list = service.draft(calls) if calls else []
        except Exception as e:
            log.warning("drafting for %d sequence(s) failed: %s", len(calls), e)
            for call in calls:
                service.release(call.seq_id)
            drafts = [RuntimeError(f"drafter: {e}")] * len(calls)
        seconds = time.perf_counter() - start
        answers = iter(d if isinstance(d, Exception) else (d, seconds) for d in drafts)
        return [None if isinstance(row, Release) else next(answers) for row in rows]

    return run_rows


class GatheredDrafter:
    """The orchestrator's Drafter for a head that drafts in the `speculative` model's process,
    on the verify thread (one OpenMP team for both; `run` puts a call there): concurrent
    sequences' draft calls are gathered into one propose, as their verify steps are."""

    def __init__(self, service: DraftService, run: Callable[[Callable[[], list]], list]) -> None:
        self.info = drafter_info(service)
        rows = drafting(service)
        self.batcher = StepBatcher(lambda batch: run(lambda: rows(batch)))

    def draft(self, call: DraftCall) -> tuple[Draft, float]:
        return self.batcher.submit(call)

    def release(self, seq_id: int) -> None:
        self.batcher.release(seq_id)
