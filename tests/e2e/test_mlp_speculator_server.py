"""MLP speculator heads through the real server: three stages fitted to the tiny target, written
by the method's writer and served (tests/fixtures/head_server.py's ServedHeadTests), whole and
with its LM heads cut to a token map."""

from __future__ import annotations

import pytest
import torch

from backends.methods.mlp_speculator import MLPSpeculatorHead, save_mlp_speculator
from tests.fixtures.head_server import ServedHeadTests, fit_and_save, soft_cross_entropy

H, V = 64, 384


@pytest.fixture(scope="module")
def fitted_dir(tiny_model_dir, tmp_path_factory, target):
    """Three untied stages fitted to the target's distributions, teacher-forced with the
    target's own tokens; heads start as the target's LM head."""
    config = {"emb_dim": H, "inner_dim": 0, "vocab_size": V, "n_predict": 3, "scale_input": True}
    head = MLPSpeculatorHead(config, target)
    with torch.no_grad():
        for lm in head.head:
            lm.weight.copy_(target.weight("lm_head"))

    def loss(head, s):
        n, stages = s.ids.shape[1], 3
        tokens = torch.stack([s.ids[:, 1 + i : n - stages + 1 + i] for i in range(stages)], dim=-1)
        probs = torch.stack([s.probs[:, 1 + i : n - stages + 1 + i] for i in range(stages)], dim=-2)
        return soft_cross_entropy(head(s.hidden[:, : n - stages], tokens), probs)

    return fit_and_save(head, loss, tiny_model_dir, save_mlp_speculator, tmp_path_factory.mktemp("mlp-fitted") / "head")


class TestServed(ServedHeadTests):
    METHOD = "mlp_speculator"


class TestServedTokenMap(ServedHeadTests):
    """The same head, its LM heads cut to a token map (speculative_token_map)."""

    METHOD = "mlp_speculator"
    TOKEN_MAP = True
