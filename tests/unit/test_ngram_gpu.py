"""`ngram_gpu`: the batched match equals `ngram`'s proposals; the OpenAI Triton kernel equals its
torch reference (under the Triton interpreter on CPU, compiled on a GPU host)."""

import os
import random

import pytest
import torch

from backends.config import SpeculativeConfig
from backends.methods.ngram import NgramProposer
from backends.methods.ngram_gpu import NgramGPUProposer
from backends.serving.proposer import DraftRequest, build_proposer
from kernels import ngram as nk

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
UNBOUNDED = 1 << 40  # ngram_gpu has no max_model_len clamp


def random_batch(rng, size):
    vocab = rng.randint(1, 4)
    return [[rng.randrange(vocab) for _ in range(rng.randint(0, 14))] for _ in range(size)]


def check_rows(drafts, num_valid, expected, k):
    assert drafts.shape == (len(expected), k) and drafts.dtype == num_valid.dtype == torch.int32
    for row, count, want in zip(drafts.tolist(), num_valid.tolist(), expected):
        assert count == len(want)
        assert row == want + [nk.PAD_TOKEN_ID] * (k - len(want))


def test_batched_equals_ngram_on_random_sequences():
    rng = random.Random(0)
    no_match = 0
    for _ in range(200):
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 5)
        batch = random_batch(rng, rng.randint(1, 6))
        drafter = NgramGPUProposer(min_n, max_n, k, device="cpu")
        expected = [NgramProposer(min_n, max_n, k, UNBOUNDED).propose(seq) for seq in batch]
        no_match += sum(not e for e in expected)
        check_rows(*drafter.propose_batch(batch), expected, k)
    assert no_match > 50  # the no-match rows were exercised too


@pytest.mark.parametrize("seed", range(3))
def test_kernel_matches_torch_reference(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    min_n = rng.randint(1, 3)
    max_n = rng.randint(min_n, 4)
    k = rng.choice([1, 3, 5])
    lens = torch.randint(0, 40, (7,), generator=gen)
    lens[0], lens[1] = 0, 1  # rows too short to match
    # A row longer than one kernel block, with its match in the second block.
    long_row = torch.randint(0, 50, (2500,), generator=gen)
    long_row[-max_n:] = long_row[1500 : 1500 + max_n]
    tokens = torch.randint(0, 3, (8, 2500), generator=gen)
    tokens[7], lens = long_row, torch.cat([lens, torch.tensor([2500])])
    tokens, lens = tokens.to(DEVICE), lens.to(DEVICE)
    got = nk.ngram_match(tokens, lens, min_n, max_n, k)
    want = nk.ngram_match_ref(tokens, lens, min_n, max_n, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1][0] == got[1][1] == 0 and got[1][7] > 0
    expected = [
        NgramProposer(min_n, max_n, k, UNBOUNDED).propose(t[:n].tolist()) for t, n in zip(tokens.cpu(), lens.tolist())
    ]
    check_rows(got[0].cpu(), got[1].cpu(), expected, k)


def test_padding_and_valid_counts():
    tokens = torch.tensor(
        [
            [1, 2, 3, 4, 5, 1, 2, 0],  # "1 2" matches: 3 4 5 1 2
            [1, 2, 3, 1, 2, 0, 0, 0],  # "1 2" matches: 3 1 2, then the end
            [1, 2, 3, 4, 0, 0, 0, 0],  # no match
            [9, 0, 0, 0, 0, 0, 0, 0],
        ]
    )  # shorter than min_n + 1
    lens = torch.tensor([7, 5, 4, 1])
    for match in (nk.ngram_match_ref, nk.ngram_match):
        drafts, num_valid = match(tokens.to(DEVICE), lens.to(DEVICE), 2, 3, 4)
        assert drafts.cpu().tolist() == [[3, 4, 5, 1], [3, 1, 2, -1], [-1] * 4, [-1] * 4]
        assert num_valid.cpu().tolist() == [4, 3, 0, 0]


def test_drafter_from_registry_is_not_clamped_by_max_model_len():
    config = SpeculativeConfig.from_json(
        '{"method": "ngram_gpu", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    )
    drafter = build_proposer(config, max_model_len=6)
    assert isinstance(drafter, NgramGPUProposer)
    tokens = [4, 5, 6, 7, 4, 5]  # ngram with max_model_len=6 would give nothing here
    drafts = drafter.propose([DraftRequest(1, tokens, 3), DraftRequest(2, [1, 2], 3), DraftRequest(3, tokens, 1)])
    assert [d.token_ids for d in drafts] == [[6, 7, 4], [], [6]]
    tokens += [6, 9, 4, 5, 6]  # grows in place; only the new tokens are taken in
    assert drafter.propose([DraftRequest(1, tokens, 3)])[0].token_ids == [7, 4, 5]
    drafter.release(1)
    drafter.release(3)
    assert len(drafter.history) == 1
