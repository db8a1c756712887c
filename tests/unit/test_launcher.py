"""The launcher's repository patching (its servers: tests/e2e/test_launcher_server.py). Who
loads what in a repository: tests/unit/test_topology.py."""

from __future__ import annotations

import re
import shutil

import pytest

from backends.runtime.model_store import context_window, load_config, model_context_window
from backends.triton_models.pbtxt import get_parameter, instance_group, parameters, set_parameter
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


def test_threads_reach_every_model_through_the_environment(monkeypatch):
    """`--threads N` becomes TRITONSPEC_THREADS in the server's environment, which every stub
    inherits and backends/runtime/threads.py reads; without it the models choose for themselves."""
    from backends.runtime.threads import THREADS_ENV
    from client.cli.main import build_parser

    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert THREADS_ENV not in TritonServer.environment()
    assert TritonServer.environment(3)[THREADS_ENV] == "3"
    assert build_parser().parse_args(["serve", "--threads", "1"]).threads == 1
    assert build_parser().parse_args(["perf", "--threads", "2"]).threads == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--threads", "0"])
    with pytest.raises(ValueError, match="threads must be at least 1"):
        TritonServer(threads=0)
