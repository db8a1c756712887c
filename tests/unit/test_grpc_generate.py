"""grpc_generate's stream handling (client/api/triton.py) around a recording stand-in for
tritonclient's gRPC client: which endings cancel the request on the server."""

from __future__ import annotations

import pytest
import tritonclient.grpc as grpcclient

from client.api.triton import GenerationError, GenerationTimeout, grpc_generate


class RecordingClient:
    """Answers a request with `answer` ((result, error) or nothing) and records each stop_stream
    that closes the stream (a later one is a no-op, as tritonclient's is)."""

    answer: tuple | None = None
    stops: list[bool] = []

    def __init__(self, url: str) -> None:
        self.callback = None

    def start_stream(self, callback) -> None:
        self.callback = callback
        self.open = True

    def async_stream_infer(self, *args, **kwargs) -> None:
        if self.answer is not None:
            self.callback(*self.answer)

    def stop_stream(self, cancel_requests: bool = False) -> None:
        if self.open:
            RecordingClient.stops.append(cancel_requests)
        self.open = False

    def close(self) -> None:
        pass


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setattr(grpcclient, "InferenceServerClient", RecordingClient)
    RecordingClient.stops = []
    return RecordingClient


def test_an_error_response_ends_the_request_without_cancelling_it(client):
    """The server's error is the request's last response. Cancelling the request it ended
    (what the client did) left Triton 2.51 unable to unload the model at the next stop when
    it came under load (docs/measurements.md, the 30-minute chaos soak)."""
    client.answer = (None, "max_tokens must be at least 1, got 0")
    with pytest.raises(GenerationError, match="max_tokens must be at least 1"):
        grpc_generate("127.0.0.1:1", "hello", max_tokens=0)
    assert client.stops == [False]


def test_a_request_that_times_out_is_cancelled(client):
    client.answer = None  # never answered
    with pytest.raises(GenerationTimeout):
        grpc_generate("127.0.0.1:1", "hello", max_tokens=4, timeout_s=0.2)
    assert True in client.stops
