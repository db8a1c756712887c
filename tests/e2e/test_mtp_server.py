"""MTP heads through the real server: a DeepSeek-layout layer fitted to the tiny target, written
by the method's writer and served (tests/fixtures/head_server.py's ServedHeadTests), drafting
chains and a static speculative_token_tree."""

from __future__ import annotations

import json

import pytest

from backends.methods.mtp import MTPHead, save_mtp
from tests.fixtures.head_server import ServedHeadTests, fit_and_save, next_token_loss


@pytest.fixture(scope="module")
def fitted_dir(tiny_model_dir, tmp_path_factory, target):
    """A DeepSeek-layout MTP layer over the target's own block config, fitted to the target's
    distributions one token further (embedding and LM head stay the target's)."""
    head = MTPHead(json.loads((tiny_model_dir / "config.json").read_text()), target)
    for name, param in head.named_parameters():
        param.requires_grad = name not in head.borrowed

    return fit_and_save(head, next_token_loss, tiny_model_dir, save_mtp, tmp_path_factory.mktemp("mtp-fitted") / "head")


class TestServed(ServedHeadTests):
    METHOD = "mtp"


class TestServedStaticTree(ServedHeadTests):
    METHOD = "mtp"
    EXTRA = {"speculative_token_tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]}
