"""docker-compose.yml cannot be run here (no registry, no engine): check its structure."""
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_serves_the_repository_with_a_health_check():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    triton = compose["services"]["triton"]
    assert triton["image"].startswith("nvcr.io/nvidia/tritonserver:")
    release = triton["image"].split(":")[1].split("-")[0]
    assert tuple(map(int, release.split("."))) >= (24, 10)  # tritonserver >= 2.51
    command = " ".join(triton["command"])
    assert "--model-repository /workspace/model_repository" in command
    assert "pip install" in command
    assert "/v2/health/ready" in " ".join(triton["healthcheck"]["test"])
    assert any(v.endswith(":/root/.cache/tritonspec") for v in triton["volumes"])
    assert "model-cache" in compose["volumes"]
