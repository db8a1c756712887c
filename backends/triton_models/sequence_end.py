"""Ending the sequences of refused requests, so that they hold none of Triton's sequence slots.

Triton's sequence batcher gives a request's correlation id a slot before the model sees the
request, and keeps it until a request of that sequence carries the END flag or the sequence has
been idle for `max_sequence_idle_microseconds` (120 s in the shipped configs). The internal
models (`verifier`, `drafter`) refuse requests from anyone but the `speculative` model, and a
model standing by refuses every request: without an END, each refused sequence held its slot
for the whole idle timeout. 500 token-less requests (256 slots) made a normal request wait 80 s.

So each refusal of a request without END is followed by an END of its own sequence: a BLS
request from this model to itself, carrying the internal token and empty required inputs,
sent from a thread of its own once the refusing execute() has returned (the batcher runs the
END after it). The model answers that END as any END (a release of state it never had, or the
standing-by refusal), and Triton frees the slot.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import Any

import numpy as np

from backends.triton_models.common import SEQUENCE_END, bls
from backends.triton_models.peer_token import with_token

log = logging.getLogger("tritonspec.sequences")
# Refusals whose END is still to be sent; past this many the others' slots wait for the idle timeout.
MAX_PENDING_ENDS = 4096
_DTYPES = {
    "TYPE_BOOL": np.bool_,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_UINT64": np.uint64,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


def end_inputs(model_config: dict) -> dict[str, np.ndarray]:
    """The smallest tensors a request to this model must carry: each required input, with a
    batch dimension of 1 where the model batches and every variable dimension empty."""
    batch = [1] if int(model_config.get("max_batch_size", 0)) > 0 else []
    inputs = {}
    for spec in model_config.get("input", []):
        if spec.get("optional"):
            continue
        shape = batch + [max(int(d), 0) for d in spec.get("dims", [])]
        inputs[spec["name"]] = np.zeros(shape, dtype=_DTYPES[spec["data_type"]])
    return inputs


class SequenceEnder:
    """Sends an END for the sequence of each refused request (see the module's doc)."""

    def __init__(self, args: dict, token: str | None) -> None:
        self.model_name = args["model_name"]
        config = json.loads(args["model_config"])
        self.sequences = "sequence_batching" in config  # else Triton holds no slot to free
        self.inputs = end_inputs(config)
        self.parameters = with_token(None, token) if token else {}
        self.pending: queue.Queue[int] = queue.Queue(MAX_PENDING_ENDS)
        threading.Thread(target=self._send, name=f"{self.model_name}-ends", daemon=True).start()

    def refused(self, request: Any) -> None:
        """`request` was refused: end its sequence unless it ends it itself."""
        if not self.sequences or request.flags() & SEQUENCE_END:
            return
        try:
            self.pending.put_nowait(request.correlation_id())
        except queue.Full:
            log.warning("too many refused sequences to end; their slots wait for the idle timeout")

    def _send(self) -> None:
        while True:
            seq_id = self.pending.get()
            try:
                bls(self.model_name, self.inputs, [], seq_id, SEQUENCE_END, self.parameters)
            except Exception as e:  # the sequence ended meanwhile, or the model is unloading
                log.debug("END of refused sequence %d: %s", seq_id, e)
