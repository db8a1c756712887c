"""A request's steps without a model: Generation's plan / draft / verify / emit over scripted
peers, the Session's replies (what each response carries), and the stream's shaping."""

from __future__ import annotations

import json

import pytest
import torch

from backends.config import DrafterConfig, SpeculativeConfig
from backends.serving.detokenize import TextStream
from backends.serving.logits import TokenLogprob
from backends.serving.orchestrator import Generation, ServingContext, StepOutput, generate
from backends.serving.parameters import prefill_chunk_tokens, stream_interval
from backends.serving.proposer import Draft, DrafterInfo
from backends.serving.request import GenerationRequest, RequestError, SamplingParams, is_greedy
from backends.serving.session import ServedModel, Session, coalesce
from backends.serving.target import VerifyRequest, VerifyResult

EOS = 0


class Letters:
    """A tokenizer of one letter per token: 1 = "a", 2 = "b", ...; 0 is EOS (no text)."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) - 96 for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(96 + i) for i in ids if i != EOS)


class Target:
    """A verifier whose target continues the prompt with `reference`: it accepts the drafts that
    match it and emits them and one more (nothing for a prompt chunk), with one hidden row per
    position it kept (new tokens and accepted drafts), and records every request."""

    def __init__(self, reference: list[int]) -> None:
        self.reference, self.done, self.requests = reference, 0, []

    def verify(self, req: VerifyRequest) -> VerifyResult:
        self.requests.append(req)
        accepted, tokens = 0, []
        if not req.prefill_only:
            drafts, ahead = req.draft_token_ids, self.reference[self.done :]
            while accepted < len(drafts) and drafts[accepted] == ahead[accepted]:
                accepted += 1
            tokens = ahead[: accepted + 1]
            self.done += len(tokens)
        rows = torch.zeros(len(req.new_token_ids) + accepted, 1, 2)
        return VerifyResult(tokens, accepted, 0.0, rows, [TokenLogprob(t, -0.5, 1) for t in tokens])

    def release(self, seq_id: int) -> None:
        pass


class Oracle:
    """A drafter proposing `reference` (the target's own continuation), recording its calls."""

    def __init__(self, reference: list[int], prompt_len: int, k: int = 2, tree: bool = False) -> None:
        spec = {"method": "ngram", "num_speculative_tokens": k}
        if tree:
            spec = {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_use_tree_spec": True}
        self.info = DrafterInfo(DrafterConfig.from_speculative(SpeculativeConfig.from_json(spec)), ())
        self.reference, self.seen, self.calls = reference, -prompt_len, []

    def draft(self, call):
        self.calls.append(call)
        self.seen += len(call.new_token_ids)
        return Draft(self.reference[self.seen : self.seen + call.num_draft_tokens]), 0.0

    def release(self, seq_id: int) -> None:
        pass


def generation(prompt, verifier, drafter=None, max_model_len=64, prefill_chunk=0, **request) -> Generation:
    req = GenerationRequest(prompt="".join(chr(96 + t) for t in prompt), **request)
    ctx = ServingContext({EOS}, max_model_len, adaptive=False, prefill_chunk=prefill_chunk)
    return Generation(req, prompt, 7, verifier, drafter, TextStream(Letters(), req.stop, prompt), ctx)


# --- Generation: one step's pieces ---------------------------------------------------------


def test_a_chunked_prompts_hidden_rows_reach_the_drafter_at_once_after_its_last_chunk():
    """The drafter's first call comes before the prompt's last chunk is verified: the earlier
    chunks' rows wait, and the next call gets the whole prompt's rows with the step's."""
    reference, prompt = [7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 19]
    verifier, drafter = Target(reference), Oracle(reference, len(prompt))
    gen = generation(prompt, verifier, drafter, prefill_chunk=3, max_tokens=6)
    steps = list(generate(gen))
    assert [s.token_ids for s in steps] == [[], [], [7, 8, 9], [10, 11, 12]]
    assert [len(r.new_token_ids) for r in verifier.requests] == [3, 3, 1, 0]  # it keeps what it emitted
    assert drafter.calls[0].new_token_ids == prompt and drafter.calls[0].hidden_states is None
    # 3 + 3 rows of the chunks, 1 + 2 of the step that verified the last token and two drafts
    assert drafter.calls[1].new_token_ids == [7, 8, 9] and drafter.calls[1].hidden_states.shape[0] == 9
    assert steps[-1].finish_reason == "length" and gen.stats.acceptance.num_accepted_tokens == 4


@pytest.mark.parametrize(
    ("reference", "fields", "out", "text", "finish"),
    [
        ([5, EOS, 6, 7, 8], {}, [5, EOS], "e", "stop"),  # EOS ends the output, with no text
        ([5, EOS, 6, 7, 8], {"ignore_eos": True, "max_tokens": 4}, [5, EOS, 6, 7], "efg", "length"),
        ([5, 6, 7, 8, 9], {"stop_token_ids": [6]}, [5, 6], "e", "stop"),
        ([5, 6, 7, 8, 9], {"stop": ["f"]}, [5, 6], "e", "stop"),  # a stop string: the token is out, its text not
        ([5, 6, 7, 8, 9], {"max_tokens": 2}, [5, 6], "ef", "length"),
    ],
)
def test_emit_ends_the_output_inside_a_step_where_the_request_says(reference, fields, out, text, finish):
    gen = generation([1, 2], Target(reference), Oracle(reference, 2, k=4), **fields)
    steps = list(generate(gen))
    assert len(steps) == 1 and steps[0].token_ids == out  # all five tokens verified, cut here
    assert steps[0].text == text and steps[0].finish_reason == finish
    assert steps[0].logprobs == [TokenLogprob(t, -0.5, 1) for t in out]


def test_the_context_window_ends_the_output_and_bounds_k_and_the_tree():
    """A step never asks for drafts, or tree nodes, past the window: here 4 tokens are left."""
    reference = [3, 4, 5, 6, 7, 8]
    gen = generation([1, 2], Target(reference), Oracle(reference, 2, k=8, tree=True), max_model_len=6, max_tokens=6)
    plan = gen.plan()
    assert plan.num_draft_tokens == 3 and 0 < plan.num_nodes <= 3  # k + 1 tokens fit; nodes the window less one
    step = gen.emit(gen.verify(plan, gen.draft(plan)))
    assert step.token_ids == [3, 4, 5, 6] and step.finish_reason == "length"


def test_a_request_for_no_drafts_never_calls_the_drafter():
    verifier, drafter = Target([3, 4]), Oracle([3, 4], 2)
    steps = list(generate(generation([1, 2], verifier, drafter, max_tokens=2, num_draft_tokens=0)))
    assert [s.token_ids for s in steps] == [[3], [4]] and drafter.calls == []
    assert all(r.draft_token_ids == [] for r in verifier.requests)


def test_sampling_goes_with_the_first_verify_only():
    verifier = Target([3, 4])
    list(generate(generation([1, 2], verifier, max_tokens=2, sampling=SamplingParams(temperature=0.5, seed=1))))
    assert verifier.requests[0].sampling.temperature == 0.5 and verifier.requests[0].max_new_tokens == 2
    assert verifier.requests[1].sampling is None and verifier.requests[1].max_new_tokens is None


def test_greedy_has_one_definition():
    """Below vLLM's _SAMPLING_EPS a temperature is greedy, for the request as for the sampler
    (a seeded request at such a temperature is not a sampled one: its k may follow the load)."""
    assert SamplingParams().greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert is_greedy(torch.tensor([0.0, 1e-6, 0.5])).tolist() == [True, True, False]


# --- Session: what each reply carries ------------------------------------------------------


def served(**kwargs) -> ServedModel:
    ctx = ServingContext({EOS}, 64, adaptive=False)
    return ServedModel(Letters(), 27, lambda t: chr(96 + t), ctx, **kwargs)


def outputs(reply) -> dict:
    return {name: value.tolist() for name, value in reply.outputs().items()}


def test_an_unstreamed_request_gets_one_response_with_the_whole_output():
    session = Session(served(), GenerationRequest(prompt="ab", max_tokens=4), seq_id=3)
    replies = list(session.replies(Target([3, 4, 5, 6]), None))
    assert [r.outputs is None for r in replies] == [True, True, True, False] and replies[-1].final
    last = outputs(replies[-1])
    assert last["text_output"] == [b"abcdef"] and last["output_ids"] == [3, 4, 5, 6]  # prompt included
    assert last["finish_reason"] == [b"length"] and last["num_input_tokens"] == [2]
    assert last["num_output_tokens"] == [4] and json.loads(last["perf_metrics"][0])["num_steps"] == 4


def test_a_streamed_request_gets_each_steps_text_and_the_vllm_outputs_asked_for():
    req = GenerationRequest(
        prompt="ab", max_tokens=3, stream=True, exclude_input_in_output=True, returns=frozenset({"cumulative_logprob"})
    )
    session = Session(served(), req, seq_id=3)
    assert session.req.sampling.logprobs == 0  # the sum needs them
    replies = list(session.replies(Target([3, 4, 5]), None))
    sent = [outputs(r) for r in replies]
    assert [s["text_output"] for s in sent] == [[b"c"], [b"d"], [b"e"]] and sent[2]["output_ids"] == [5]
    assert [s["cumulative_logprob"] for s in sent] == [[-0.5], [-1.0], [-1.5]]
    assert "finish_reason" not in sent[0] and sent[2]["finish_reason"] == [b"length"]


def test_a_stream_interval_merges_steps():
    req = GenerationRequest(prompt="ab", max_tokens=5, stream=True, exclude_input_in_output=True, stream_interval=3)
    replies = list(Session(served(), req, seq_id=3).replies(Target([3, 4, 5, 6, 7]), None))
    assert [outputs(r)["output_ids"] for r in replies] == [[3], [4, 5, 6], [7]]


def test_a_cancelled_request_ends_with_no_response_of_its_own():
    session = Session(served(), GenerationRequest(prompt="ab", max_tokens=8), seq_id=3)
    asked = iter([False, True])
    replies = list(session.replies(Target([3]), None, lambda: next(asked)))
    assert [r.step.finish_reason for r in replies] == [None, "cancelled"] and replies[-1].outputs is None


def test_a_session_refuses_what_does_not_fit_the_served_model():
    with pytest.raises(RequestError, match="outside the vocabulary"):
        Session(served(), GenerationRequest(prompt="ab", stop_token_ids=[99]), seq_id=3)
    with pytest.raises(RequestError, match="context window"):  # when its first step is asked for
        next(Session(served(), GenerationRequest(prompt="a" * 64), seq_id=3).replies(Target([]), None))


# --- the stream's shaping -------------------------------------------------------------------


def test_prefill_chunk_tokens_is_checked():
    assert prefill_chunk_tokens("256") == 256 and prefill_chunk_tokens("0") == 0
    for bad in ("-1", "lots", "2.5"):
        with pytest.raises(ValueError, match="prefill_chunk_tokens must be a whole number of tokens"):
            prefill_chunk_tokens(bad)


def test_stream_interval_is_checked():
    assert stream_interval("1") == 1 and stream_interval("16") == 16
    for bad in ("0", "-2", "many", "2.5"):
        with pytest.raises(ValueError, match="stream_interval must be a whole number of tokens >= 1"):
            stream_interval(bad)


def test_coalesced_steps_carry_at_least_the_interval_and_lose_nothing():
    def step(ids: list[int], finish: str | None = None, hidden: bool = False) -> StepOutput:
        rows = torch.full((len(ids) or 1, 1, 2), float(ids[0] if ids else -1)) if hidden else None
        logprobs = [TokenLogprob(t, -0.5, 1) for t in ids]
        return StepOutput(ids, "".join(f"<{t}>" for t in ids), finish, rows, logprobs)

    # a prefill chunk (hidden rows, no tokens), then steps of 2, 1, 1, 3, 1 and a last one of 1
    steps = [step([], hidden=True), step([1, 2], hidden=True), step([3]), step([4]), step([5, 6, 7]), step([8])]
    steps.append(step([9], "stop"))
    out = list(coalesce(iter(steps), 4))
    assert [s.token_ids for s in out] == [[1, 2], [3, 4, 5, 6, 7], [8, 9]]
    assert [s.finish_reason for s in out] == [None, None, "stop"]
    assert "".join(s.text for s in out) == "".join(s.text for s in steps)
    assert [lp.token_id for s in out for lp in s.logprobs] == list(range(1, 10))
    assert out[0].hidden_states[:, 0, 0].tolist() == [-1.0, 1.0, 1.0]  # the chunk's rows, then the step's
    assert out[1].hidden_states is None and out[2].hidden_states is None
    # 1: every step with tokens as it came; a finish below the interval still goes out
    assert [s.token_ids for s in coalesce(iter(steps), 1)] == [s.token_ids for s in steps[1:]]
    assert [s.token_ids for s in coalesce(iter([step([1]), step([2]), step([], "length")]), 8)] == [[1], [2]]
