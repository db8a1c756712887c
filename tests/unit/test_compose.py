"""docker-compose.yml and deploy/ cannot run here (no registry, no engine): the compose files
are validated against the Compose Specification's JSON schema (as vendored by
check-jsonschema), and every cross-reference is checked: image and release, the model
repository and cache paths, GPU reservation, health check, ports, nginx upstreams,
Prometheus targets, Grafana provisioning, the load test's input, and docs/deployment.md."""

from __future__ import annotations

import copy
import json
import re
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml

from client.cli.launcher import needs_auto_complete
from tests.fixtures import ROOT
from tests.fixtures.deploy import DEPLOY, load_compose, loadtest_args


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose("docker-compose.yml")


@pytest.fixture(scope="module")
def schema() -> dict:
    path = resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    return json.loads(path.read_text())


def _validate(schema: dict, compose: dict) -> None:
    jsonschema.validators.validator_for(schema)(schema).validate(compose)


def container_ports(service: dict) -> dict[int, int]:
    """{container port: host port} of "host_ip:host:container" entries."""
    return {int(p.rsplit(":", 1)[1]): int(p.rsplit(":", 2)[1]) for p in service.get("ports", [])}


def mounts(service: dict) -> dict[str, str]:
    """{target: source} of short-syntax volumes."""
    return {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}


def triton_flags(compose: dict) -> dict[str, str]:
    """{flag: value} of the triton service's tritonserver command ("" for a flag without one)."""
    command = compose["services"]["triton"]["command"]
    flags = (arg.removeprefix("--").partition("=") for arg in command[command.index("--") + 2 :])
    return {name: value for name, _, value in flags}


def command_flags(command: list[str]) -> dict[str, str]:
    """{flag: value} of a command's "--flag=value" and "--flag value" arguments."""
    flags, words = {}, iter(command)
    for word in words:
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            flags[name] = value if eq else next(words, "")
    return flags


def dockerfile() -> tuple[str, str]:
    """(the FROM line with ARGs substituted, the whole text)."""
    text = (DEPLOY / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base), text


# nginx's gRPC listener inside the compose network (unpublished): the `openai` front end and the load test.
INTERNAL_GRPC_PORT = 8011


def release(image: str) -> tuple[int, int]:
    return tuple(map(int, image.split(":")[1].split("-")[0].split(".")))


# ---------------------------------------------------------------------------- compose file


def test_compose_files_validate_against_the_compose_spec(compose, schema):
    _validate(schema, compose)
    cpu = load_compose("docker-compose.yml", "deploy/cpu.yml")
    _validate(schema, cpu)
    assert "devices" not in cpu["services"]["triton"]["deploy"]["resources"]["reservations"]
    broken = copy.deepcopy(compose)
    broken["services"]["triton"]["imagee"] = "typo"
    with pytest.raises(jsonschema.ValidationError, match="imagee"):
        _validate(schema, broken)


def test_triton_runs_nvidias_image_with_the_project_installed(compose):
    base, text = dockerfile()
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d+\.\d+-py3", base)
    assert release(base) >= (24, 10)  # tritonserver >= 2.51
    for service in ("models", "triton", "openai"):
        build = compose["services"][service]["build"]
        assert build["dockerfile"] == "deploy/Dockerfile" and build["context"] == "."
        assert build["args"]["TRITON_RELEASE"] == base.split(":")[1].removesuffix("-py3")
    assert "pip install --no-cache-dir ." in text
    workdir = re.search(r"^WORKDIR (\S+)", text, re.M).group(1)
    for part in ("backends", "client", "kernels", "model_repository", "pyproject.toml"):
        assert re.search(rf"^COPY {part}\b", text, re.M), part
        assert f"!{part}" in (ROOT / ".dockerignore").read_text()
    repository = triton_flags(compose)["model-repository"]
    assert repository == f"{workdir}/model_repository"
    assert mounts(compose["services"]["triton"])[repository] == "./model_repository"
    # Without auto-completion only while the mounted configs leave nothing to fill in.
    assert "disable-auto-complete-config" in triton_flags(compose)
    assert not needs_auto_complete(ROOT / "model_repository")


def test_gpus_are_reserved_and_the_model_cache_is_a_volume(compose):
    triton = compose["services"]["triton"]
    devices = triton["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    cache = re.search(r"^ENV TRITONSPEC_CACHE=(\S+)$", dockerfile()[1], re.M).group(1)
    for service in ("models", "triton", "openai"):
        assert mounts(compose["services"][service])[cache] == "model-cache"
    assert "model-cache" in compose["volumes"]
    # The one-shot fetch fills the cache with the model the repository serves before any replica starts.
    served = {
        re.search(r'key: "model" value: \{ string_value: "([^"]+)"', p.read_text()).group(1)
        for p in (ROOT / "model_repository").glob("*/config.pbtxt")
    }
    assert compose["services"]["models"]["command"] == ["tritonspec", "models", "fetch", *served]
    assert triton["depends_on"]["models"]["condition"] == "service_completed_successfully"


def test_triton_stops_gracefully_within_the_containers_stop_grace_period(compose):
    """`docker stop` signals `tritonspec tritonserver`, which drains the server: the grace
    period ends before tritonserver's exit timeout, and both before Docker's SIGKILL."""
    from client.cli.main import build_parser

    triton = compose["services"]["triton"]
    command = triton["command"]
    assert command[:2] == ["tritonspec", "tritonserver"] and command[command.index("--") + 1] == "tritonserver"
    grace = build_parser().parse_args(command[1:]).shutdown_grace_s
    exit_timeout = int(triton_flags(compose)["exit-timeout-secs"])
    assert 0 < grace < exit_timeout < int(triton["stop_grace_period"].removesuffix("s"))


def test_health_check_is_tritons_readiness(compose):
    triton = compose["services"]["triton"]
    check = " ".join(triton["healthcheck"]["test"])
    assert f"http://localhost:{triton_flags(compose)['http-port']}/v2/health/ready" in check
    assert compose["services"]["lb"]["depends_on"]["triton"]["condition"] == "service_healthy"


# ---------------------------------------------------------------------------- nginx, replicas


def nginx_blocks(text: str) -> dict:
    """{"upstream NAME": [directive, ...], "server": [[directive, ...], ...]} of nginx.conf's
    http block, after checking that braces balance and directives end with `;`."""
    text = re.sub(r"#[^\n]*", "", text)
    assert text.count("{") == text.count("}")
    for line in filter(None, (ln.strip() for ln in text.splitlines())):
        assert line.endswith((";", "{", "}")), line
    out: dict = {"server": []}
    for kind, name, body in re.findall(r"(upstream|server)\s+(\w*)\s*\{((?:[^{}]|\{[^{}]*\})*)\}", text):
        directives = [d.strip() for d in re.sub(r"\{|\}", ";", body).split(";") if d.strip()]
        if kind == "upstream":
            out[f"upstream {name}"] = directives
        else:
            out["server"].append(directives)
    return out


def test_replicas_sit_behind_nginx(compose):
    triton, lb = compose["services"]["triton"], compose["services"]["lb"]
    assert (
        int(triton["deploy"]["replicas"]) == 1 and "${TRITON_REPLICAS:-1}" in (ROOT / "docker-compose.yml").read_text()
    )
    assert "ports" not in triton  # replicas would clash on host ports; clients use lb
    assert mounts(lb)["/etc/nginx/nginx.conf"] == "./deploy/nginx.conf"
    conf = nginx_blocks((DEPLOY / "nginx.conf").read_text())
    flags = triton_flags(compose)
    assert f"server triton:{flags['http-port']}" in conf["upstream triton_http"]
    assert f"server triton:{flags['grpc-port']}" in conf["upstream triton_grpc"]
    listens = {int(d.split()[1]): d for server in conf["server"] for d in server if d.startswith("listen")}
    # Published: HTTP and gRPC for clients; the internal gRPC listener only on the compose network.
    assert set(container_ports(lb)) == {int(flags["http-port"]), int(flags["grpc-port"])}
    assert set(listens) == {*container_ports(lb), INTERNAL_GRPC_PORT}
    http, grpc = (
        next(s for s in conf["server"] if f"listen {p}" in s) for p in (flags["http-port"], flags["grpc-port"])
    )
    assert "proxy_pass http://triton_http" in http and "proxy_buffering off" in http  # SSE streams
    assert "grpc_pass grpc://triton_grpc" in grpc and "http2 on" in grpc


# ---------------------------------------------------------------------------- monitoring


def test_prometheus_scrapes_every_triton_replica(compose):
    prometheus = compose["services"]["prometheus"]
    assert mounts(prometheus)["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus.yml"
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["triton"] and sd["type"] == "A"
    assert sd["port"] == int(triton_flags(compose)["metrics-port"]) and job["metrics_path"] == "/metrics"


def test_grafana_is_provisioned_with_the_dashboard(compose):
    grafana = compose["services"]["grafana"]
    volumes = mounts(grafana)
    provisioning = volumes["/etc/grafana/provisioning"].removeprefix("./")
    (source,) = yaml.safe_load((ROOT / provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    host, port = re.fullmatch(r"http://(\w+):(\d+)", source["url"]).groups()
    assert source["type"] == "prometheus" and int(port) in container_ports(compose["services"][host])
    (provider,) = yaml.safe_load((ROOT / provisioning / "dashboards" / "tritonspec.yml").read_text())["providers"]
    folder = volumes[provider["options"]["path"]].removeprefix("./")
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    dashboard = json.loads((ROOT / folder / Path(home).name).read_text())
    assert home == f"{provider['options']['path']}/{Path(home).name}"
    assert dashboard["uid"] == "tritonspec"
    assert {"type": "datasource", "query": "prometheus"}.items() <= dashboard["templating"]["list"][0].items()


# ---------------------------------------------------------------------------- load test, OpenAI


def speculative_inputs() -> set[str]:
    text = (ROOT / "model_repository" / "speculative" / "config.pbtxt").read_text()
    return set(re.findall(r'\{\s*name:\s*"(\w+)"', text.split("output [")[0]))


def test_loadtest_runs_perf_analyzer_from_the_sdk_image_through_the_balancer(compose):
    loadtest = compose["services"]["loadtest"]
    base, _ = dockerfile()
    assert loadtest["image"] == f"{base}-sdk" and loadtest["profiles"] == ["loadtest"]
    args = loadtest_args(compose)
    value = dict(zip(args, args[1:]))
    # perf_analyzer reads model configs and statistics: the internal listener passes them.
    assert value["-u"] == f"lb:{INTERNAL_GRPC_PORT}" and value["-i"] == "grpc" and "--streaming" in args
    assert value["-m"] == "speculative"
    assert mounts(loadtest)[value["--input-data"]] == "./deploy/perf_input.json"
    assert Path(value["--profile-export-file"]).parent.as_posix() in mounts(loadtest)
    rows = json.loads((DEPLOY / "perf_input.json").read_text())["data"]
    assert rows and all(set(row) <= speculative_inputs() and "text_input" in row for row in rows)


def test_openai_service_talks_grpc_through_the_balancer(compose):
    openai = compose["services"]["openai"]
    args = openai["command"]
    value = command_flags(args)
    assert args[:2] == ["tritonspec", "openai"] and value["--url"] == f"lb:{INTERNAL_GRPC_PORT}"
    assert value["--host"] == "0.0.0.0" and int(value["--port"]) in container_ports(openai)
    assert f":{value['--port']}/health" in " ".join(openai["healthcheck"]["test"])
    # The internet-facing front end reads the model cache only: the replicas load kernel
    # libraries from it.
    assert openai["volumes"] == ["model-cache:/models:ro"]


def test_openai_service_passes_the_front_doors_limits_and_key(compose, monkeypatch):
    """The command parses as `tritonspec openai` parses it, into the limits given; the API key
    comes from TRITONSPEC_API_KEY, which the service passes through (unset: no key)."""
    from client.api.openai_http import API_KEY_ENV
    from client.cli.main import build_parser, door_policy

    openai = compose["services"]["openai"]
    args = build_parser().parse_args(openai["command"][1:])
    assert f"${{{API_KEY_ENV}:-}}" in (ROOT / "docker-compose.yml").read_text()
    assert set(openai["environment"]) == {API_KEY_ENV}
    monkeypatch.setenv(API_KEY_ENV, "sk-deploy")
    policy = door_policy(args)
    assert (policy.max_body_bytes, policy.max_concurrent_requests, policy.api_key) == (8 * 2**20, 128, "sk-deploy")
    assert {"--max-body-bytes", "--max-concurrent-requests"} <= set(command_flags(openai["command"]))


# ---------------------------------------------------------------------------- what is published


def test_monitoring_binds_apart_from_the_api(compose):
    """The API may face the internet (TRITONSPEC_BIND) while Prometheus, which has no
    authentication, and Grafana stay on their own bind (TRITONSPEC_MONITORING_BIND, loopback
    by default); Grafana signs users in (no anonymous access)."""
    raw = yaml.load((ROOT / "docker-compose.yml").read_text(), Loader=yaml.SafeLoader)["services"]
    for name in ("lb", "openai"):
        assert all(p.startswith("${TRITONSPEC_BIND:-127.0.0.1}:") for p in raw[name]["ports"]), name
    for name in ("prometheus", "grafana"):
        assert all(p.startswith("${TRITONSPEC_MONITORING_BIND:-127.0.0.1}:") for p in raw[name]["ports"]), name
    published = {name for name, service in raw.items() if service.get("ports")}
    assert published == {"lb", "openai", "prometheus", "grafana"}
    grafana = compose["services"]["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_AUTH_ANONYMOUS_ORG_ROLE" not in grafana
    assert raw["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_ADMIN_PASSWORD:-admin}"


def grpc_methods(port: int) -> re.Pattern:
    """The gRPC paths nginx's server on `port` passes to Triton, as one pattern."""
    text = (DEPLOY / "nginx.conf").read_text()
    server = re.search(rf"listen {port};(.*?)\n    \}}", text, re.S).group(1)
    (passed,) = re.findall(r"location ~ (\S+) \{\s*grpc_pass", server)
    return re.compile(passed)


# Every method of Triton 2.51's GRPCInferenceService (grpc_service.proto).
GRPC_METHODS = (
    "ServerLive ServerReady ModelReady ServerMetadata ModelMetadata ModelInfer ModelStreamInfer ModelConfig "
    "ModelStatistics RepositoryIndex RepositoryModelLoad RepositoryModelUnload SystemSharedMemoryStatus "
    "SystemSharedMemoryRegister SystemSharedMemoryUnregister CudaSharedMemoryStatus CudaSharedMemoryRegister "
    "CudaSharedMemoryUnregister TraceSetting LogSettings"
).split()


def test_public_grpc_passes_only_health_metadata_and_streams():
    """What docs/deployment.md says clients get over gRPC: health, metadata and streamed
    inference; not model configs or statistics, nor unary ModelInfer (the `speculative` model
    answers only streams: unary inference reaches nothing but the internal models)."""
    public = {m for m in GRPC_METHODS if grpc_methods(8001).fullmatch(f"/inference.GRPCInferenceService/{m}")}
    assert public == {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelStreamInfer"}
    internal = {
        m for m in GRPC_METHODS if grpc_methods(INTERNAL_GRPC_PORT).fullmatch(f"/inference.GRPCInferenceService/{m}")
    }
    assert internal == public | {"ModelConfig", "ModelStatistics"}
    docs = " ".join((ROOT / "docs" / "deployment.md").read_text().split())
    assert "on gRPC only health, metadata and streamed inference" in docs


def test_the_deployment_page_documents_images_ports_and_volumes(compose):
    section = (ROOT / "docs" / "deployment.md").read_text()
    base, _ = dockerfile()
    for image in (
        base,
        f"{base}-sdk",
        compose["services"]["lb"]["image"],
        compose["services"]["prometheus"]["image"],
        compose["services"]["grafana"]["image"],
    ):
        assert image in section, image
    for name, service in compose["services"].items():
        assert f"`{name}`" in section, name
        for host in container_ports(service).values():
            assert re.search(rf"\b{host}\b", section), (name, host)
    for volume in compose["volumes"]:
        assert f"`{volume}`" in section, volume
    for path in (
        "deploy/Dockerfile",
        "deploy/nginx.conf",
        "deploy/prometheus.yml",
        "deploy/cpu.yml",
        "deploy/grafana/dashboards/tritonspec.json",
        "deploy/perf_input.json",
    ):
        assert path in section and (ROOT / path).exists(), path
