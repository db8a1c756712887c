"""Keep Python's garbage collector from pausing a serving process.

A process that has imported torch, transformers or FastAPI and loaded a tokenizer holds 330-415k
objects the cyclic collector tracks, nearly all of them alive for the life of the process. A
full (oldest-generation) collection walks every one: 160-175 ms in the OpenAI front end on an
idle 2-core Zen 4 host, longer on saturated cores. CPython runs one whenever the objects that
survived into the oldest generation since the last one reach a quarter of it, so under steady
traffic one comes every few minutes, and for its length the process does nothing else: the
front end answered /health in 203 ms once in a 30-minute soak, and a stub's step would stall
the same way.

`freeze_startup_heap` moves what start-up built into the permanent generation, which no
collection walks (`gc.freeze`, Python 3.7+); collections then walk only what serving allocates.
vLLM does the same after its engine starts (`freeze_gc_heap` in vllm/utils/gc_utils.py,
https://github.com/vllm-project/vllm). A collection that still takes longer than
`SLOW_COLLECTION_MS` is logged, so a pause has a name in the log.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

log = logging.getLogger("tritonspec.gc")

SLOW_COLLECTION_MS = 50.0


class SlowCollections:
    """A gc callback that logs every collection that takes longer than `limit_ms`."""

    def __init__(self, process: str, limit_ms: float = SLOW_COLLECTION_MS) -> None:
        self.process, self.limit_ms = process, limit_ms
        self.started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        ms = (time.perf_counter() - self.started) * 1e3
        if ms > self.limit_ms:
            log.warning(
                "%s: a garbage collection (generation %d, %d objects freed, %d tracked outside the frozen "
                "start-up heap) paused this process for %.0f ms",
                self.process,
                info["generation"],
                info["collected"],
                len(gc.get_objects()),
                ms,
            )


def freeze_startup_heap(process: str) -> SlowCollections:
    """Collect once, then freeze every object alive now out of later collections' walks; log
    slow collections from here on. Call at the end of a process's start-up. Returns the
    callback (in `gc.callbacks`)."""
    gc.collect()  # what is garbage now must not be frozen: it would never be freed
    gc.freeze()
    # At exit the interpreter's last collections must see them again: extension modules check
    # for leaks as they unload (OpenAI Triton's nanobind printed ~80 lines of "leaked" objects
    # into the server log at every stop).
    atexit.register(gc.unfreeze)
    log.info("%s: %d start-up objects frozen out of garbage collection", process, gc.get_freeze_count())
    watch = SlowCollections(process)
    gc.callbacks.append(watch)
    return watch
