"""One client request served, between the Triton model and the loop: its GenerationRequest bound
to the served model and tokenized, the Generation that decodes it, and each step turned into the
outputs of a response (text, ids, the vLLM backend's return_* outputs, extracted hidden states,
the statistics). `triton_models/speculative.py` only reads a request's tensors into a
GenerationRequest and turns these outputs into Triton responses.

    session = Session(served, parse_request(tensors), seq_id)
    for reply in session.replies(verifier, drafter, is_cancelled):
        ...  # reply.step: what the loop yielded; reply.outputs(), if set: a response to send
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backends.methods.extract_hidden_states import save_hidden_states
from backends.serving.detokenize import TextStream
from backends.serving.logits import TokenLogprob, vllm_logprobs
from backends.serving.orchestrator import (
    Drafter,
    Generation,
    GenerationStats,
    ServingContext,
    StepOutput,
    Verifier,
    generate,
)
from backends.serving.request import GenerationRequest, bind_token_ids, check_prompt_size

Outputs = dict[str, np.ndarray]  # a response's output tensors by name


@dataclass(frozen=True)
class ServedModel:
    """What every request to one `speculative` model shares."""

    tokenizer: Any
    vocab_size: int  # what token ids in a request may name
    decode_token: Callable[[int], str]  # one token's text (the logprobs output names tokens)
    generation: ServingContext
    stream_interval: int = 1  # streamed responses carry at least this many tokens (a request may set its own)
    hidden_states_dir: str = ""  # extract_hidden_states: each request's hidden states are also written here


@dataclass
class Reply:
    """One step of a request as the client sees it: `outputs`, when set, builds the response
    to send (on the thread that sends it, so the work overlaps the next forward)."""

    step: StepOutput
    outputs: Callable[[], Outputs] | None = None

    @property
    def final(self) -> bool:
        return self.step.finish_reason is not None


class Session:
    """A request bound to the served model (token ids checked, bad words tokenized), its prompt
    tokenized, and the replies of its steps; RequestError names what the client got wrong."""

    def __init__(self, served: ServedModel, req: GenerationRequest, seq_id: int) -> None:
        ctx = served.generation
        req = bind_token_ids(req, served.tokenizer, set(ctx.eos_token_ids), served.vocab_size)
        self.vllm = VllmOutputs(req, served.decode_token)
        if "cumulative_logprob" in req.returns and req.sampling.logprobs is None:
            req = replace(req, sampling=replace(req.sampling, logprobs=0))  # the sum needs them
        check_prompt_size(req.prompt, ctx.max_model_len)  # before tokenizing megabytes
        self.served, self.req, self.seq_id = served, req, seq_id
        self.prompt_ids: list[int] = served.tokenizer(req.prompt)["input_ids"]
        self.text = TextStream(served.tokenizer, req.stop, self.prompt_ids)
        self.stats = GenerationStats()
        self.output_ids: list[int] = []

    def replies(
        self, verifier: Verifier, drafter: Drafter | None, is_cancelled: Callable[[], bool] = lambda: False
    ) -> Iterator[Reply]:
        """A Reply per step (merged to the stream interval when streaming), until the last, which
        has a finish_reason ("cancelled": the client left, nothing more to send). A streamed step
        with text, tokens or a finish carries a response; otherwise only the last does, with the
        whole output."""
        gen = Generation(
            self.req, self.prompt_ids, self.seq_id, verifier, drafter, self.text, self.served.generation, self.stats
        )
        steps = generate(gen, is_cancelled)
        interval = self.req.stream_interval or self.served.stream_interval
        if self.req.stream and interval > 1:
            steps = coalesce(steps, interval)
        logprobs: list[TokenLogprob] = []
        prompt = PromptLogprobs(self.req, self.served.decode_token)
        hidden: list[torch.Tensor] = []
        for step in steps:
            self.output_ids += step.token_ids
            logprobs += step.logprobs or []
            prompt.scored += step.prompt_logprobs or []
            if step.hidden_states is not None:
                hidden.append(step.hidden_states)
            if step.finish_reason == "cancelled":
                yield Reply(step)
                return
            extra = self._hidden_outputs(hidden) if step.finish_reason is not None else {}
            if self.req.stream and (step.text or step.token_ids or step.finish_reason):
                extra.update(self.vllm.outputs(step.finish_reason, len(self.prompt_ids), step.token_ids, step.logprobs))
                extra.update(prompt.outputs())
                yield Reply(step, self._outputs(step, step.token_ids, step.text, extra))
            elif not self.req.stream and step.finish_reason is not None:
                body = self.text.text if self.req.exclude_input_in_output else self.req.prompt + self.text.text
                extra.update(self.vllm.outputs(step.finish_reason, len(self.prompt_ids), self.output_ids, logprobs))
                extra.update(prompt.outputs())
                yield Reply(step, self._outputs(step, list(self.output_ids), body, extra))
            else:
                yield Reply(step)

    def _outputs(self, step: StepOutput, token_ids: list[int], text: str, extra: Outputs) -> Callable[[], Outputs]:
        num_input, num_output = len(self.prompt_ids), len(self.output_ids)
        return lambda: response_outputs(step, token_ids, text, num_input, num_output, self.stats, extra)

    def _hidden_outputs(self, parts: list[torch.Tensor]) -> Outputs:
        """The extracted hidden states of the whole request (rows for positions 0 .. prompt +
        output - 2), their layer ids, and the file they were written to when asked."""
        if not parts:
            return {}
        token_ids, layer_ids = self.prompt_ids + self.output_ids, self.served.generation.extract_layer_ids
        hidden = torch.cat(parts)[: len(token_ids) - 1]  # never a position past the output
        outputs = {"hidden_states": hidden.float().numpy(), "hidden_layer_ids": np.array(layer_ids, dtype=np.int32)}
        if self.served.hidden_states_dir:
            path = save_hidden_states(
                Path(self.served.hidden_states_dir) / f"{self.seq_id}.safetensors",
                hidden,
                token_ids,
                layer_ids,
                len(self.prompt_ids),
            )
            outputs["hidden_states_file"] = np.array([str(path).encode()], dtype=np.object_)
        return outputs


def coalesce(steps: Iterable[StepOutput], interval: int) -> Iterator[StepOutput]:
    """Steps merged so that each carries at least `interval` tokens (vLLM's and SGLang's
    `--stream-interval`): the first tokens and the last step go out as soon as they come, the
    rest waits for company. Each streamed response costs the server process work of its own
    (gRPC/HTTP encoding, the Python backend's IPC) beside the forward on the same cores, so
    fewer, fuller responses leave more of them to decoding. 1: every step with tokens as it
    comes (steps without any, a prompt chunk's, join the next)."""
    held: list[StepOutput] = []
    held_tokens, started = 0, False
    for step in steps:
        held.append(step)
        held_tokens += len(step.token_ids)
        if step.finish_reason is not None or held_tokens >= interval or (held_tokens and not started):
            yield held[0] if len(held) == 1 else _merge(held)
            started = started or held_tokens > 0
            held, held_tokens = [], 0


def _merge(steps: list[StepOutput]) -> StepOutput:
    hidden = [s.hidden_states for s in steps if s.hidden_states is not None]
    with_logprobs = any(s.logprobs is not None for s in steps)
    with_prompt = any(s.prompt_logprobs is not None for s in steps)
    return StepOutput(
        [token for s in steps for token in s.token_ids],
        "".join(s.text for s in steps),
        steps[-1].finish_reason,
        torch.cat(hidden) if hidden else None,
        [entry for s in steps for entry in s.logprobs or []] if with_logprobs else None,
        [entry for s in steps for entry in s.prompt_logprobs or []] if with_prompt else None,
    )


def response_outputs(
    step: StepOutput,
    token_ids: list[int],
    text: str,
    num_input: int,
    num_output: int,
    stats: GenerationStats,
    extra: Outputs | None = None,
) -> Outputs:
    """A streamed step carries its text and ids (and `extra`: the outputs the return_* flags
    asked for); the last response also the statistics (and, from an extract_hidden_states
    drafter, the hidden states)."""
    outputs = {
        "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.array(token_ids, dtype=np.int64),
    }
    if step.finish_reason is not None:
        acceptance = stats.acceptance
        outputs.update(
            {
                "finish_reason": np.array([step.finish_reason.encode()], dtype=np.object_),
                "num_input_tokens": np.array([num_input], dtype=np.uint32),
                "num_output_tokens": np.array([num_output], dtype=np.uint32),
                "total_draft_tokens": np.array([acceptance.num_draft_tokens], dtype=np.int64),
                "total_accepted_draft_tokens": np.array([acceptance.num_accepted_tokens], dtype=np.int64),
                "acceptance_rate": np.array([acceptance.acceptance_rate or 0.0], dtype=np.float32),
                "perf_metrics": np.array([json.dumps(stats.to_dict()).encode()], dtype=np.object_),
            }
        )
    outputs.update(extra or {})  # the vLLM backend's flagged outputs go on every response
    return outputs


class VllmOutputs:
    """The vLLM backend's additional outputs a request asked for with its return_* flags,
    with that backend's meaning, on every response: num_output_tokens and logprobs of this
    response's tokens, num_input_tokens, cumulative_logprob of the output so far, and
    finish_reason ("None" until the last response)."""

    def __init__(self, req: GenerationRequest, decode: Callable[[int], str]) -> None:
        self.returns = req.returns
        self.report_logprobs = req.sampling.logprobs is not None  # else the logprobs output is "null"
        self.decode = decode
        self.cumulative = 0.0

    def outputs(
        self, finish_reason: str | None, num_input: int, token_ids: list[int], logprobs: list[TokenLogprob] | None
    ) -> Outputs:
        self.cumulative += sum(p.logprob for p in logprobs or [])
        values = {
            "finish_reason": lambda: np.array([str(finish_reason).encode()], dtype=np.object_),
            "num_input_tokens": lambda: np.array([num_input], dtype=np.uint32),
            "num_output_tokens": lambda: np.array([len(token_ids)], dtype=np.uint32),
            "cumulative_logprob": lambda: np.array([self.cumulative], dtype=np.float32),
            "logprobs": lambda: np.array(
                [json.dumps(vllm_logprobs(logprobs or [], self.decode) if self.report_logprobs else None).encode()],
                dtype=np.object_,
            ),
        }
        return {name: values[name]() for name in self.returns}


class PromptLogprobs:
    """The `prompt_logprobs` output of a request that asked for them (vLLM's): null for the
    first prompt token, then per token {token id: {"logprob", "rank", "decoded_token"}} as
    in the `logprobs` output, all on the first response (vLLM returns them at once when the
    prefill ends; vllm/v1/engine/logprobs.py, pop_prompt_logprobs, at vLLM commit dfafe710)."""

    def __init__(self, req: GenerationRequest, decode: Callable[[int], str]) -> None:
        self.due = req.sampling.prompt_logprobs is not None
        self.decode = decode
        self.scored: list[TokenLogprob] = []

    def outputs(self) -> Outputs:
        if not self.due:
            return {}
        self.due = False
        entries = [None, *vllm_logprobs(self.scored, self.decode)]
        return {"prompt_logprobs": np.array([json.dumps(entries).encode()], dtype=np.object_)}
