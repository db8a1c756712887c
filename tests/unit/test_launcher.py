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


def test_auto_complete_is_off_only_when_every_config_is_complete(tmp_path):
    """The project's configs name inputs, outputs and batch size: the server starts without
    auto-completion (one stub start less per model). A repository with a model that leaves any
    of them to its backend keeps it on."""
    import shutil

    from client.cli.launcher import DEFAULT_REPOSITORY, needs_auto_complete

    assert not needs_auto_complete(DEFAULT_REPOSITORY)
    for field in ("input", "output", "max_batch_size"):
        repository = tmp_path / field
        shutil.copytree(DEFAULT_REPOSITORY, repository)
        config = repository / "drafter" / "config.pbtxt"
        text = config.read_text()
        assert f"\n{field}" in text
        config.write_text(text.replace(f"\n{field}", "\n# removed:"))
        assert needs_auto_complete(repository), field
