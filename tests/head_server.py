"""Shared by the tests of the heads that draft from the target's final hidden state
(medusa, mlp_speculator, mtp): contexts to draft after, the batching check, and the served
tests. For those, a head is fitted in a few seconds to the tiny target (so its drafts
overlap the target's distribution and get accepted), written with the method's `save_*`
writer and served; then greedy output must equal the target's own and sampled output must
follow the target's distribution (ServedHeadTests: the two tests each such module runs).

The fit distils the target's top-k distributions at temperature 0.3 while the sampled test
asks for temperature 1.5 after "The dog", where the tiny target's next tokens are spread: q
overlaps p (most drafts pass) but is much sharper, so a sampler that uses q wrongly (in the
acceptance test or in the recovery distribution) shifts the output distribution by 0.1-0.2
in total variation (a sampler that ignores q altogether treats each draft as one-hot, which
is exact for any draft)."""
from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from backends.serving.proposer import Draft, DraftRequest
from client.api.triton import grpc_generate
from tests.helpers import _load, coarse_total_variation, hf_greedy, served_greedy_results

# Token ids (of the tiny target's vocabulary) the in-process tests draft after.
CONTEXTS = [[5, 17, 42, 99, 3, 250, 7], [300, 12, 12, 12], [44, 45, 46, 47, 48, 49, 50, 51, 52, 53]]
# The served tests.
GREEDY_PROMPTS = ["def add(a, b):\n    return a + b\ndef add(a, b):", "The quick brown fox", "for i in range(10):"]
PROMPT, TEMPERATURE, TOP_K, FIT_TEMPERATURE = "The dog", 1.5, 4, 0.3
SAMPLES, POSITIONS = 600, 3


@dataclass
class Sequences:
    """Sequences of one length, batched."""

    ids: torch.Tensor  # [B, n]
    hidden: torch.Tensor  # [B, n, H] the target's final normed states
    probs: torch.Tensor  # [B, n, V] the target's next-token distributions (FIT_TEMPERATURE, top-k)


@torch.no_grad()  # plain tensors: the fit backpropagates through heads that read them
def teacher(target_dir: Path, num_sampled: int = 48) -> list[Sequences]:
    """The target's states and distributions over its greedy continuations of the greedy
    prompts and over short continuations of the sampled test's prompt, drawn as it draws."""
    model, tokenizer = _load(str(target_dir))
    gen = torch.Generator().manual_seed(0)
    sampled = torch.tensor([tokenizer(PROMPT)["input_ids"]] * num_sampled)
    for _ in range(4):
        top = (model(input_ids=sampled).logits[:, -1] / TEMPERATURE).topk(TOP_K)
        pick = torch.multinomial(top.values.softmax(-1), 1, generator=gen)
        sampled = torch.cat([sampled, top.indices.gather(1, pick)], dim=1)
    batches = [torch.tensor([tokenizer(p)["input_ids"] + list(hf_greedy(str(target_dir), p, 24))])
               for p in GREEDY_PROMPTS] + [sampled]
    out = []
    for ids in batches:
        result = model(input_ids=ids, output_hidden_states=True)
        top = (result.logits.float() / FIT_TEMPERATURE).topk(TOP_K)
        probs = torch.zeros_like(result.logits, dtype=torch.float32).scatter_(-1, top.indices, top.values.softmax(-1))
        out.append(Sequences(ids, result.hidden_states[-1].float(), probs))
    return out


def fit(head: torch.nn.Module, loss, data: list[Sequences], steps: int = 80, lr: float = 1e-2) -> None:
    """Full-batch Adam on `loss(head, sequences)` summed over `data`, on one thread (tensors
    this small run ~10x slower when threads contend for shared cores)."""
    torch.manual_seed(0)
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    head.train()
    try:
        for _ in range(steps):
            total = sum(loss(head, s) for s in data)
            optimizer.zero_grad()
            total.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    head.eval()


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    return -(probs * logits.log_softmax(-1)).sum(-1).mean()


def fit_and_save(head: torch.nn.Module, loss, target_dir: Path, save: Callable[[torch.nn.Module, Path], None],
                 out: Path) -> Path:
    """`head` fitted by `loss` to the target's distributions (teacher) and written to `out`."""
    fit(head, loss, teacher(target_dir))
    save(head, out)
    return out


def assert_batched_equals_one_at_a_time(proposer, hidden: list[torch.Tensor], ks: tuple[int, ...]) -> list[Draft]:
    """Drafts k = ks[i] tokens after CONTEXTS[i] (delivered rows `hidden`) in one batch that
    also holds a sequence the target has not run yet (no drafts): each is what drafting its
    request alone gives. Returns the batch's drafts."""
    requests = [DraftRequest(i, ids, k, rows) for i, (ids, rows, k) in enumerate(zip(CONTEXTS, hidden, ks))]
    requests.append(DraftRequest(9, CONTEXTS[0], 3))  # the target has not run yet: no drafts
    together = proposer.propose(requests)
    assert [len(d.token_ids) for d in together] == [*ks, 0]
    for req, draft in zip(requests, together):
        assert draft.token_ids == proposer.propose([req])[0].token_ids
    return together


K = 3  # the served heads' num_speculative_tokens


def start_head_server(tmp_path: Path, target_dir: Path, method: str, head_dir: Path):
    from tests.conftest import start_server

    config = {"method": method, "model": str(head_dir), "num_speculative_tokens": K,
              "draft_sample_method": "probabilistic"}
    return start_server(tmp_path, str(target_dir), json.dumps(config))


def check_served_greedy(server, target_dir: Path) -> None:
    """Greedy output is the target's own, and the head's drafts are accepted: a greedy
    request drafts the argmax even though the server drafts probabilistically."""
    results = served_greedy_results(server, target_dir, GREEDY_PROMPTS, 24, num_draft_tokens=K)
    drafts = sum(r.total_draft_tokens for r in results)
    assert sum(r.total_accepted_draft_tokens for r in results) > drafts // 10, [
        (r.total_draft_tokens, r.total_accepted_draft_tokens) for r in results]


def exact_marginals(model_dir: Path, num_tokens: int) -> list[dict[int, float]]:
    """The target's distribution of each of the first sampled tokens after PROMPT (top-k,
    temperature), summed over every path of top-k tokens before it."""
    model, tokenizer = _load(str(model_dir))
    paths = {tuple(tokenizer(PROMPT)["input_ids"]): 1.0}
    marginals = []
    for _ in range(num_tokens):
        marginal, longer = {}, {}
        for context, p in paths.items():
            with torch.inference_mode():
                top = (model(input_ids=torch.tensor([context])).logits[0, -1] / TEMPERATURE).topk(TOP_K)
            for token, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist()):
                marginal[token] = marginal.get(token, 0.0) + p * q
                longer[context + (token,)] = p * q
        marginals.append(marginal)
        paths = longer
    return marginals


def check_sampled_distribution(server, target_dir: Path, min_accepted: int) -> None:
    """Output positions 0..2 of many seeded requests against the exact marginals. The first
    token comes from the prompt's forward (no hidden state has reached the drafter yet);
    positions 1 and 2 are always drafted (two drafts in the second step; after a rejection
    the third step drafts position 2), so a wrong q shows there."""
    exact = exact_marginals(target_dir, POSITIONS)

    def one(seed):
        return grpc_generate(server.grpc_url, PROMPT, max_tokens=POSITIONS + 1, temperature=TEMPERATURE,
                             top_k=TOP_K, random_seed=seed, ignore_eos=True)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(SAMPLES)))
    assert all(r.total_draft_tokens >= 2 for r in results)
    drafts = sum(r.total_draft_tokens for r in results)
    accepted = sum(r.total_accepted_draft_tokens for r in results)
    assert min_accepted < accepted < drafts - min_accepted, (accepted, drafts)  # both outcomes, many times
    for position in range(POSITIONS):
        tv = coarse_total_variation([r.output_ids[position] for r in results], exact[position])
        assert tv < 0.09, (position, tv)


class ServedHeadTests:
    """A method's fitted head served on the tiny target: greedy output is the target's own,
    sampled output follows the target's distribution. A module subclasses this as
    `TestServed` with METHOD, and provides a `fitted_dir` fixture (the head written by the
    method's writer)."""

    METHOD: str

    @pytest.fixture(scope="class")
    @classmethod
    def server(cls, tiny_model_dir, fitted_dir, tmp_path_factory):
        server = start_head_server(tmp_path_factory.mktemp(f"{cls.METHOD}-server"), tiny_model_dir, cls.METHOD,
                                   fitted_dir)
        yield server
        server.stop()

    def test_served_greedy_equals_target_greedy(self, server, tiny_model_dir):
        check_served_greedy(server, tiny_model_dir)

    def test_served_sampling_follows_the_target_distribution(self, server, tiny_model_dir):
        check_sampled_distribution(server, tiny_model_dir, min_accepted=150)
