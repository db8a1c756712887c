"""The launcher's repository patching (its servers: tests/e2e/test_launcher_server.py)."""

from __future__ import annotations

import re
import shutil

import pytest

from backends.config import IN_ORCHESTRATOR_METHODS
from backends.runtime.model_store import context_window, load_config, model_context_window
from backends.serving.proposer import proposer_class, registered_methods
from backends.triton_models.pbtxt import (
    drafted_in_process,
    get_parameter,
    in_process_choice,
    instance_group,
    parameters,
    set_parameter,
    verified_in_process,
    verifies_in_process,
)
from client.cli.launcher import DEFAULT_REPOSITORY, OPENMP_SPIN_COUNT, TritonServer


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
    from client.cli.launcher import needs_auto_complete

    assert not needs_auto_complete(DEFAULT_REPOSITORY)
    for field in ("input", "output", "max_batch_size"):
        repository = tmp_path / field
        shutil.copytree(DEFAULT_REPOSITORY, repository)
        config = repository / "drafter" / "config.pbtxt"
        text = config.read_text()
        assert f"\n{field}" in text
        config.write_text(text.replace(f"\n{field}", "\n# removed:"))
        assert needs_auto_complete(repository), field


def test_a_config_reads_as_its_parameters_and_instance_group():
    text = (DEFAULT_REPOSITORY / "verifier" / "config.pbtxt").read_text()
    params = parameters(text)
    assert params["model"] == "smollm2-135m" and params["kv_cache_memory_gb"] == "4"
    assert all(get_parameter(text, key) == value for key, value in params.items())
    assert instance_group(text) == ("KIND_CPU", 0)
    assert instance_group(text.replace("kind: KIND_CPU", "kind: KIND_GPU gpus: [ 2, 3 ]")) == ("KIND_GPU", 2)
    assert instance_group('name: "m"') == ("", 0)


def test_the_verifier_stands_by_only_when_every_orchestrator_naming_it_verifies_in_process(tmp_path):
    repository = tmp_path / "repo"
    shutil.copytree(DEFAULT_REPOSITORY, repository)
    speculative = repository / "speculative" / "config.pbtxt"
    verifier = repository / "verifier" / "config.pbtxt"
    shipped, shipped_verifier = speculative.read_text(), verifier.read_text()
    # Shipped ("auto"): one CPU verifier instance, one orchestrator: verified in its process.
    assert get_parameter(shipped, "verifier_in_process") == "auto"
    assert in_process_choice({}) == "auto" and in_process_choice({"verifier_in_process": " TRUE "}) == "true"
    with pytest.raises(ValueError, match="verifier_in_process must be one of auto, true, false, got 'yes'"):
        in_process_choice({"verifier_in_process": "yes"})
    assert verifies_in_process(repository, "speculative", num_gpus=0)
    assert verified_in_process(repository, "verifier", num_gpus=0) == ("speculative",)
    assert verified_in_process(repository, "other_verifier", num_gpus=0) == ()
    speculative.write_text(set_parameter(shipped, "verifier_in_process", "false"))
    assert verified_in_process(repository, "verifier", num_gpus=0) == ()
    speculative.write_text(set_parameter(shipped, "batch_verify_steps", "false"))  # auto needs batched steps
    assert not verifies_in_process(repository, "speculative", num_gpus=0)
    speculative.write_text(shipped)
    verifier.write_text(shipped_verifier.replace("count: 1", "count: 2"))  # auto: not with two instances
    assert not verifies_in_process(repository, "speculative", num_gpus=0)
    speculative.write_text(set_parameter(shipped, "verifier_in_process", "true"))  # "true": even then
    assert verified_in_process(repository, "verifier", num_gpus=0) == ("speculative",)
    verifier.write_text(shipped_verifier)
    second = repository / "speculative_bls"
    second.mkdir()
    (second / "config.pbtxt").write_text(set_parameter(shipped, "verifier_in_process", "false"))
    assert verified_in_process(repository, "verifier", num_gpus=0) == ()  # a second calls it over BLS
    speculative.write_text(shipped)
    (second / "config.pbtxt").write_text(shipped)
    # Two "auto" orchestrators naming one verifier share it over BLS rather than load two copies.
    assert not verifies_in_process(repository, "speculative", num_gpus=0)
    assert verified_in_process(repository, "verifier", num_gpus=0) == ()


def test_the_drafter_stands_by_only_when_every_orchestrator_naming_it_drafts_in_process(tmp_path):
    repository = tmp_path / "repo"
    shutil.copytree(DEFAULT_REPOSITORY, repository)
    speculative = repository / "speculative" / "config.pbtxt"
    shipped = speculative.read_text()
    # Shipped: ngram, drafter_in_process "true": drafted in the orchestrator's process.
    assert drafted_in_process(repository, "drafter", "ngram") == ("speculative",)
    assert drafted_in_process(repository, "drafter", "suffix") == ("speculative",)
    for method in ("ngram_gpu", "draft_model", "eagle3", "custom_class"):  # these draft in the drafter model
        assert drafted_in_process(repository, "drafter", method) == ()
    assert drafted_in_process(repository, "other_drafter", "ngram") == ()  # nobody names it
    speculative.write_text(shipped.replace('key: "drafter_in_process"', 'key: "unset"'))  # on by default
    assert drafted_in_process(repository, "drafter", "ngram") == ("speculative",)
    for value in ("false", "no"):  # off, or a value the orchestrator's own load refuses
        speculative.write_text(set_parameter(shipped, "drafter_in_process", value))
        assert drafted_in_process(repository, "drafter", "ngram") == ()
    speculative.write_text(shipped)
    second = repository / "speculative_b"
    second.mkdir()
    (second / "config.pbtxt").write_text(shipped)
    assert drafted_in_process(repository, "drafter", "ngram") == ("speculative", "speculative_b")
    (second / "config.pbtxt").write_text(set_parameter(shipped, "drafter_in_process", "false"))
    assert drafted_in_process(repository, "drafter", "ngram") == ()  # the second one calls it


def test_the_methods_a_drafter_stands_by_for_are_those_that_draft_in_the_orchestrator():
    """The standing-by drafter knows them without importing a proposer (and torch)."""
    in_orchestrator = {m for m in registered_methods() if proposer_class(m).in_orchestrator}
    assert in_orchestrator == set(IN_ORCHESTRATOR_METHODS)


def test_the_context_window_is_read_without_transformers_where_config_json_names_it(tmp_path, tiny_model_dir):
    """What a standing-by drafter sizes its config's check with: transformers' own value."""
    assert model_context_window(tiny_model_dir) == context_window(load_config(tiny_model_dir))
    assert model_context_window(tiny_model_dir, 16) == 16
    config = (tiny_model_dir / "config.json").read_text()
    # Absent (transformers' class default: LlamaConfig's 2048), or 0 (context_window's 2048).
    for name, entry in (("absent", ""), ("zero", '"max_position_embeddings": 0,')):
        shutil.copytree(tiny_model_dir, tmp_path / name)
        (tmp_path / name / "config.json").write_text(re.sub(r'"max_position_embeddings": \d+,', entry, config))
        assert model_context_window(tmp_path / name) == context_window(load_config(tmp_path / name)) == 2048


def test_openmp_threads_stop_spinning_soon_unless_the_user_says_otherwise(monkeypatch):
    """The server's processes get a short OpenMP spin (their forwards take turns on the same
    cores); a GOMP_SPINCOUNT the user set is kept."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert TritonServer.environment()["GOMP_SPINCOUNT"] == OPENMP_SPIN_COUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert TritonServer.environment()["GOMP_SPINCOUNT"] == "300000"
