"""The launcher's repository patching (its servers: tests/e2e/test_launcher_server.py)."""

from __future__ import annotations

from backends.triton_models.pbtxt import get_parameter, set_parameter


def test_set_and_get_parameter_round_trip():
    text = 'name: "m"\nparameters: { key: "model" value: { string_value: "a" } }\n'
    text = set_parameter(text, "model", "/tmp/x")
    text = set_parameter(text, "speculative_config", '{"method": "ngram", "k": "a\\\\b"}')
    assert get_parameter(text, "model") == "/tmp/x"
    assert get_parameter(text, "speculative_config") == '{"method": "ngram", "k": "a\\\\b"}'
    assert text.count('key: "model"') == 1
