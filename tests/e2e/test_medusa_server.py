"""Medusa heads through the real server: three heads fitted to the tiny target, written in the
FasterDecoding layout and served (tests/fixtures/head_server.py's ServedHeadTests)."""

from __future__ import annotations

import pytest
import torch

from backends.methods.medusa import MedusaHead, save_medusa
from tests.fixtures.head_server import ServedHeadTests, fit_and_save, soft_cross_entropy


@pytest.fixture(scope="module")
def fitted_dir(tiny_model_dir, tmp_path_factory, target):
    """Three heads fitted to the target's distributions at t+2..t+4 (blocks start at zero,
    LM heads at the target's), saved in the FasterDecoding layout."""
    head = MedusaHead({"num_heads": 3, "num_hidden_layers": 1}, target)
    with torch.no_grad():
        for block, lm in zip(head.blocks, head.lm_heads):
            block.layers[0].weight.zero_()
            block.layers[0].bias.zero_()
            lm.weight.copy_(target.weight("lm_head"))

    def loss(head, s):
        n = s.ids.shape[1]
        return sum(
            soft_cross_entropy(head.head_logits(i, s.hidden[:, : n - 1 - i]), s.probs[:, 1 + i :]) for i in range(3)
        )

    return fit_and_save(
        head,
        loss,
        tiny_model_dir,
        lambda h, out: save_medusa(h, out, "medusa", base_model=str(tiny_model_dir)),
        tmp_path_factory.mktemp("medusa-fitted") / "head",
    )


class TestServed(ServedHeadTests):
    # When sampling, head 0 cannot see the first sampled token, which spreads over four: its q is a mixture.
    METHOD = "medusa"


class TestServedTree(ServedHeadTests):
    """The same heads drafting Medusa's static tree (several of each head's top tokens)."""

    METHOD = "medusa"
    EXTRA = {"speculative_token_tree": "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"}
