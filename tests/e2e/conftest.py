"""The fixtures only the end-to-end tests use: the shared tiny server."""

from __future__ import annotations

import pytest

from tests.fixtures.servers import fixture_server


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir, tmp_path_factory):
    yield from fixture_server(tmp_path_factory, "tiny-server", tiny_model_dir, sequence_idle_timeout_s="5")
