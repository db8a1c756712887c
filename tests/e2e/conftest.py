"""The fixtures only the end-to-end tests use: the shared tiny server."""

from __future__ import annotations

import pytest

from tests.fixtures.servers import start_server


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("tiny-server"), str(tiny_model_dir), sequence_idle_timeout_s="5")
    yield server
    server.stop()
