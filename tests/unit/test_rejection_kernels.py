"""OpenAI Triton rejection kernels against their torch references, bit for bit.

Without CUDA the kernels run in Triton's interpreter on CPU tensors: importing ``kernels`` sets
TRITON_INTERPRET=1 before triton is imported. On a GPU host they run compiled on CUDA tensors,
unless TRITON_INTERPRET=1 is set in the environment.
"""

import os

import pytest
import torch

from backends.serving.rejection import rejection_sample_batch
from kernels import rejection as rk

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def on_device(*tensors: torch.Tensor | None) -> tuple:
    return tuple(None if t is None else t.to(DEVICE) for t in tensors)


def random_batch(seed: int, vocab_size: int) -> tuple[dict, torch.Generator]:
    """Six requests, greedy and random mixed, of 0 to 4 drafts (some none), some drafts -1."""
    gen = torch.Generator().manual_seed(seed)
    batch_size = 6
    num_draft_tokens = torch.randint(0, 5, (batch_size,), generator=gen)
    num_draft_tokens[seed % batch_size] = 0
    num_tokens = int(num_draft_tokens.sum())
    drafts = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    drafts[torch.rand(num_tokens, generator=gen) < 0.15] = -1
    batch = {
        "cu_num_draft_tokens": num_draft_tokens.cumsum(0),
        "draft_token_ids": drafts,
        "draft_req_ids": torch.arange(batch_size).repeat_interleave(num_draft_tokens),
        "bonus_token_ids": torch.randint(0, vocab_size, (batch_size,), generator=gen),
        "is_greedy": torch.rand(batch_size, generator=gen) < 0.5,
    }
    return {name: t.to(DEVICE) for name, t in batch.items()}, gen


def empty_output(batch: dict) -> torch.Tensor:
    cu = batch["cu_num_draft_tokens"]
    max_spec_len = int(torch.diff(cu, prepend=cu.new_zeros(1)).max())
    return torch.full((len(cu), max_spec_len + 1), rk.PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=DEVICE)


def accept_both_ways(accept, accept_ref, batch: dict, *args: torch.Tensor) -> torch.Tensor:
    """The output rows an accept kernel fills, checked bit for bit against its torch reference."""
    out, expected = empty_output(batch), empty_output(batch)
    accept(out, *args)
    accept_ref(expected, *args)
    assert torch.equal(out, expected)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_greedy_accept_matches_ref(seed):
    batch, gen = random_batch(seed, vocab_size=16)
    drafts = batch["draft_token_ids"].cpu()
    # Targets agree with most drafts, so that runs of accepted drafts occur.
    agree = torch.rand(len(drafts), generator=gen) < 0.7
    target_argmax = torch.where(agree, drafts.clamp_min(0), torch.randint(0, 16, (len(drafts),), generator=gen))
    out = accept_both_ways(
        rk.greedy_accept,
        rk.greedy_accept_ref,
        batch,
        batch["cu_num_draft_tokens"],
        batch["draft_token_ids"],
        target_argmax.to(DEVICE),
        batch["bonus_token_ids"],
        batch["is_greedy"],
    )
    assert (out[~batch["is_greedy"]] == rk.PLACEHOLDER_TOKEN_ID).all()


@pytest.mark.parametrize("seed", range(4))
def test_random_accept_matches_ref(seed):
    batch, gen = random_batch(seed, vocab_size=16)
    num_tokens = len(batch["draft_token_ids"])
    p = torch.rand(num_tokens, generator=gen)
    q = torch.rand(num_tokens, generator=gen)
    q[torch.rand(num_tokens, generator=gen) < 0.1] = 0.0  # q = 0 never accepts
    uniform = torch.rand(num_tokens, dtype=torch.float64, generator=gen) * 0.8
    recovered = torch.randint(0, 16, (num_tokens,), generator=gen)
    out = accept_both_ways(
        rk.random_accept,
        rk.random_accept_ref,
        batch,
        batch["cu_num_draft_tokens"],
        batch["draft_token_ids"],
        *on_device(p, q, uniform, recovered),
        batch["bonus_token_ids"],
        batch["is_greedy"],
    )
    assert (out[batch["is_greedy"]] == rk.PLACEHOLDER_TOKEN_ID).all()


def test_random_accept_boundary_accepts_like_vllm():
    """p / q == u accepts (vLLM V1 compares with >=); q == 0 and -1 drafts reject."""
    cu, drafts, p, q, u, recovered, bonus, is_greedy = on_device(
        torch.tensor([1, 2, 3, 4]),
        torch.tensor([5, 5, -1, 5]),
        torch.tensor([0.25, 0.25, 1.0, 0.25]),
        torch.tensor([0.5, 0.0, 1.0, 0.5]),
        torch.tensor([0.5, 0.0, 0.0, 0.5000001], dtype=torch.float64),
        torch.full((4,), 7),
        torch.full((4,), 9),
        torch.zeros(4, dtype=torch.bool),
    )
    out = torch.full((4, 2), -1, device=DEVICE)
    rk.random_accept(out, cu, drafts, p, q, u, recovered, bonus, is_greedy)
    assert out.tolist() == [[5, 9], [7, -1], [7, -1], [7, -1]]


@pytest.mark.parametrize("with_draft_probs", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_recovered_tokens_match_ref(seed, with_draft_probs):
    vocab_size = 1500  # two vocab tiles
    batch, gen = random_batch(seed, vocab_size)
    num_tokens = len(batch["draft_token_ids"])
    target_probs = torch.rand(num_tokens, vocab_size, generator=gen).softmax(-1)
    draft_probs = torch.rand(num_tokens, vocab_size, generator=gen).softmax(-1)
    inv_noise = 1 / torch.empty(6, vocab_size).exponential_(generator=gen)
    args = (
        batch["draft_token_ids"],
        batch["draft_req_ids"],
        *on_device(target_probs, draft_probs if with_draft_probs else None, inv_noise),
        batch["is_greedy"],
    )
    recovered = rk.sample_recovered_tokens(*args)
    assert torch.equal(recovered, rk.sample_recovered_tokens_ref(*args))
    greedy_drafts = batch["is_greedy"][batch["draft_req_ids"]]
    assert (recovered[greedy_drafts] == rk.PLACEHOLDER_TOKEN_ID).all()
    assert (recovered[~greedy_drafts] >= 0).all()


def recovered_both_ways(
    draft_token_ids: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None
) -> list[int]:
    """Recovered tokens of one random request under neutral noise (a plain argmax)."""
    num_drafts = len(draft_token_ids)
    args = on_device(
        torch.tensor(draft_token_ids),
        torch.zeros(num_drafts, dtype=torch.int64),
        target_probs,
        draft_probs,
        torch.ones(1, target_probs.shape[1]),
        torch.tensor([False]),
    )
    recovered = rk.sample_recovered_tokens(*args).tolist()
    assert recovered == rk.sample_recovered_tokens_ref(*args).tolist()
    return recovered


def test_recovered_tokens_ties_and_clamped_residual():
    """Ties (across vocab tiles or inside one) go to the lowest id; negative residuals clamp."""
    target_probs = torch.full((4, 1500), 1e-4)
    target_probs[0, [1100, 5]] = 0.3  # tie across two tiles
    target_probs[1, [1100, 1300]] = 0.3  # tie inside the second tile
    draft_probs = target_probs.clone()
    draft_probs[:2] = 0.0  # residual = p in rows 0 and 1, 0 in row 2
    draft_probs[3, 0] = 2e-4  # residual 0 but -1e-4 at token 0: clamped, every token ties
    assert recovered_both_ways([0, 0, 0, 0], target_probs, draft_probs) == [5, 1100, 0, 0]


def test_recovered_token_without_draft_probs_excludes_the_draft():
    target_probs = torch.full((2, 1500), 1e-4)
    target_probs[:, 1200] = 0.5
    target_probs[:, 7] = 0.3
    assert recovered_both_ways([1200, -1], target_probs, None) == [7, 1200]


def test_batch_without_drafts_emits_bonus_tokens():
    cu, none, bonus, is_greedy = on_device(
        torch.zeros(3, dtype=torch.int64),
        torch.empty(0, dtype=torch.int64),
        torch.tensor([4, 5, 6]),
        torch.tensor([True, False, True]),
    )
    out = torch.full((3, 1), -1, device=DEVICE)
    rk.greedy_accept(out, cu, none, none, bonus, is_greedy)
    rk.random_accept(out, cu, none, none.float(), none.float(), none.double(), none, bonus, is_greedy)
    assert out.flatten().tolist() == [4, 5, 6]
    no_probs, noise = on_device(torch.empty(0, 8), torch.ones(3, 8))
    assert rk.sample_recovered_tokens(none, none, no_probs, None, noise, is_greedy).numel() == 0


def sample_mixed_batch(seed: int) -> list[list[int]]:
    """A full batch through rejection_sample_batch: seeded, unseeded and greedy requests."""
    gen = torch.Generator().manual_seed(seed)
    num_draft_tokens, vocab_size = [3, 0, 2, 4, 1], 40
    num_tokens, batch_size = sum(num_draft_tokens), len(num_draft_tokens)
    target_logits = 3 * torch.randn(num_tokens + batch_size, vocab_size, generator=gen)
    # Drafts from probabilities near the target's, so that runs of accepted drafts occur.
    req_of_draft = torch.arange(batch_size).repeat_interleave(torch.tensor(num_draft_tokens))
    draft_logits = target_logits[torch.arange(num_tokens) + req_of_draft]
    draft_probs = (draft_logits + torch.randn(num_tokens, vocab_size, generator=gen)).softmax(-1)
    drafts = torch.multinomial(draft_probs, 1, generator=gen).flatten()
    drafts[1] = -1
    torch.manual_seed(seed)
    return rejection_sample_batch(
        drafts,
        num_draft_tokens,
        target_logits,
        draft_probs if seed % 2 else None,
        temperature=torch.tensor([1.0, 0.8, 0.0, 1.2, 0.0]),
        top_k=torch.tensor([0, 5, 0, 10, 0]),
        top_p=torch.tensor([1.0, 0.9, 1.0, 0.8, 1.0]),
        generators={0: torch.Generator().manual_seed(seed), 3: torch.Generator().manual_seed(seed + 1)},
    )


@pytest.mark.skipif(not INTERPRET, reason="forces the kernel path on CPU tensors (interpreter)")
@pytest.mark.parametrize("seed", range(4))
def test_rejection_sample_batch_kernel_path_matches_torch_path(monkeypatch, seed):
    expected = sample_mixed_batch(seed)
    monkeypatch.setenv("TRITONSPEC_USE_KERNELS", "1")
    for ref in ("greedy_accept_ref", "random_accept_ref", "sample_recovered_tokens_ref"):
        monkeypatch.setattr(rk, ref, None)  # proves that the kernels, not the references, ran
    assert sample_mixed_batch(seed) == expected
