"""MTP heads through the real server: a DeepSeek-layout layer fitted to the tiny target, written
by the method's writer and served (tests/fixtures/head_server.py's ServedHeadTests), drafting
chains and a static speculative_token_tree."""

from __future__ import annotations

import json

import pytest
import torch

from backends.methods.eagle import causal_mask
from backends.methods.mtp import MTPHead, save_mtp
from tests.fixtures.head_server import ServedHeadTests, fit_and_save, soft_cross_entropy


@pytest.fixture(scope="module")
def fitted_dir(tiny_model_dir, tmp_path_factory, target):
    """A DeepSeek-layout MTP layer over the target's own block config, fitted to the target's
    distributions one token further (embedding and LM head stay the target's)."""
    head = MTPHead(json.loads((tiny_model_dir / "config.json").read_text()), target)
    for name, param in head.named_parameters():
        param.requires_grad = name not in head.borrowed

    def loss(head, s):
        n = s.ids.shape[1] - 1
        positions = torch.arange(n).expand(len(s.ids), n)
        mask = causal_mask(torch.ones(len(s.ids), n, dtype=torch.bool), n)
        out = head(s.ids[:, 1:], s.hidden[:, :-1], positions, mask, None)
        return soft_cross_entropy(head.logits(out), s.probs[:, 1:])

    return fit_and_save(head, loss, tiny_model_dir, save_mtp, tmp_path_factory.mktemp("mtp-fitted") / "head")


class TestServed(ServedHeadTests):
    METHOD = "mtp"


class TestServedStaticTree(ServedHeadTests):
    METHOD = "mtp"
    EXTRA = {"speculative_token_tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]}
