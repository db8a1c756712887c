"""deploy/k8s, the Helm chart, cannot run here (no cluster): it is rendered as `helm template`
renders it (Helm's own engine, linked in by helm-python-sdk: no binary, no network), and every
object is validated against the Kubernetes API schemas of pinned versions (kubernetes-validate's,
strict: an unknown field is an error). Then what an operator relies on: probes on Triton's
health endpoints and on ports the containers declare, the HPA on the Triton Deployment by its
name and on the metric the Prometheus adapter rule serves, Triton reached only through the
gateway, requests == limits, and the server started as docker-compose.yml starts it."""

from __future__ import annotations

import copy
import re

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from backends.triton_models.metrics import GAUGE, SERVING_METRICS
from client.api.openai_frontend import create_app
from tests.fixtures import ROOT
from tests.fixtures.deploy import DEPLOY, load_compose

CHART = DEPLOY / "k8s"
ADAPTER_VALUES = CHART / "prometheus-adapter-values.yaml"
# Schemas of a 2025 release and of the newest that kubernetes-validate 1.37.0 ships.
K8S_VERSIONS = ("1.33.0", "1.37.0")
RELEASE = "prod"  # without the chart's name in it: objects are named prod-tritonspec-<component>

# Every option that changes what is rendered, away from its default.
OTHER_VALUES = {
    "triton": {"gpus": 1, "resources": {"cpu": "2", "memory": "6Gi"}, "nodeSelector": {"pool": "cpu"}},
    "gateway": {"service": {"type": "LoadBalancer"}},
    "openai": {"apiKeySecret": "openai-key", "service": {"type": "LoadBalancer"}},
    "modelCache": {"existingClaim": "shared-models"},
    "imagePullSecrets": [{"name": "registry"}],
    "autoscaling": {"enabled": False, "minReplicas": 2},
    "networkPolicy": {"enabled": False},
    "prometheusScrape": False,
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
}
# kubernetes-validate ships the Kubernetes API's schemas, no CRD's: the ServiceMonitor is checked
# against the fields of monitoring.coreos.com/v1 it uses, as the Prometheus Operator's CRD
# declares them (example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml at
# prometheus-operator commit 01b1a0ea, v0.84.1): spec requires selector and endpoints; their
# types, the duration pattern and the scheme enum are the CRD's. Stricter than the CRD in one
# way: a field outside this subset is an error (as kubernetes-validate's strict mode).
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
STRING = {"type": "string"}
STRING_MAP = {"type": "object", "additionalProperties": STRING}


def strict_object(properties: dict, *required: str) -> dict:
    """A JSON Schema object with these properties (`required` among them) and no other."""
    return {"type": "object", "required": list(required), "additionalProperties": False, "properties": properties}


SERVICE_MONITOR_SCHEMA = strict_object(
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": strict_object({"name": STRING, "labels": STRING_MAP}, "name"),
        "spec": strict_object(
            {
                "selector": strict_object({"matchLabels": STRING_MAP}),
                "namespaceSelector": strict_object(
                    {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": STRING}}
                ),
                "endpoints": {
                    "type": "array",
                    "items": strict_object(
                        {
                            "port": STRING,
                            "path": STRING,
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": {"type": "string", "pattern": DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": DURATION},
                        }
                    ),
                },
            },
            "endpoints",
            "selector",
        ),
    },
    "apiVersion",
    "kind",
    "metadata",
    "spec",
)


def render(values: dict | None = None) -> list[dict]:
    """The objects `helm template prod deploy/k8s` prints, hooks included."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace="serving")
    yamls = [text for path, text in manifests.items() if path.endswith(".yaml")]  # not NOTES.txt
    return [doc for text in yamls for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return render()


def objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict) -> list[dict]:
    return pod(workload).get("initContainers", []) + pod(workload)["containers"]


def selects(selector: dict, workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(key) == value for key, value in selector.items())


def deployment(docs: list[dict], component: str) -> dict:
    return objects(docs, "Deployment")[f"{RELEASE}-tritonspec-{component}"]


def adapter_rule() -> dict:
    (rule,) = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    return rule


def schema_errors(docs: list[dict], version: str) -> list[str]:
    errors = []
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            errors += [
                f"ServiceMonitor: {e.message}"
                for e in jsonschema.Draft7Validator(SERVICE_MONITOR_SCHEMA).iter_errors(doc)
            ]
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as e:
            errors.append(f"{doc['kind']} {doc['metadata']['name']}: {getattr(e, 'message', e)}")
    return errors


# ---------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("values", [None, OTHER_VALUES], ids=["defaults", "every-option"])
def test_the_chart_lints_and_every_object_validates_against_the_kubernetes_schemas(values):
    report = helm.lint(CHART, values, strict=True)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report
    docs = render(values)
    assert {"Deployment", "Service", "PodDisruptionBudget", "Job"} <= {d["kind"] for d in docs}
    for version in K8S_VERSIONS:
        assert schema_errors(docs, version) == [], version


def test_the_validator_refuses_a_misspelt_field_and_a_wrong_type(docs):
    triton = deployment(docs, "triton")
    misspelt = copy.deepcopy(triton)
    pod(misspelt)["containers"][0]["imagee"] = "typo"
    wrong_type = copy.deepcopy(triton)
    wrong_type["spec"]["replicas"] = "two"
    for broken in (misspelt, wrong_type):
        assert len(schema_errors([broken], K8S_VERSIONS[0])) == 1
    (monitor,) = objects(render(OTHER_VALUES), "ServiceMonitor").values()
    misspelt, wrong_type, missing = (copy.deepcopy(monitor) for _ in range(3))
    misspelt["spec"]["endpoints"][0]["intervall"] = "15s"
    wrong_type["spec"]["endpoints"][0]["interval"] = "15 seconds"
    del missing["spec"]["selector"]
    for broken in (misspelt, wrong_type, missing):
        assert len(schema_errors([broken], K8S_VERSIONS[0])) == 1


# ---------------------------------------------------------------------------- Triton


def test_triton_starts_as_the_compose_service_does(docs):
    compose = load_compose("docker-compose.yml")["services"]
    (container,) = pod(deployment(docs, "triton"))["containers"]
    assert container["command"] == compose["triton"]["command"]
    assert container["image"] == compose["triton"]["image"]
    assert {e["name"]: e["value"] for e in container["env"]} == compose["triton"]["environment"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in container["command"][1:] if "=" in arg)
    assert ports == {
        "http": int(flags["http-port"]),
        "grpc": int(flags["grpc-port"]),
        "metrics": int(flags["metrics-port"]),
    }
    # The Python backend's shared memory: compose's shm_size, as a memory-backed volume.
    (shm,) = [v for v in pod(deployment(docs, "triton"))["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": compose["triton"]["shm_size"].upper() + "i"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_probes_ask_the_health_endpoints_on_a_declared_port(docs):
    """Triton's readiness gates start-up and traffic, its liveness restarts a hung server; the
    gateway is ready when a Triton behind it is (nginx passes that path on); the front end's
    /health is a route it serves."""
    expected = {
        "triton": {
            "startupProbe": "/v2/health/ready",
            "readinessProbe": "/v2/health/ready",
            "livenessProbe": "/v2/health/live",
        },
        "gateway": {"readinessProbe": "/v2/health/ready", "livenessProbe": None},
        "openai": {"readinessProbe": "/health", "livenessProbe": None},
    }
    for component, probes in expected.items():
        container = pod(deployment(docs, component))["containers"][0]
        ports = {p["name"] for p in container["ports"]} | {p["containerPort"] for p in container["ports"]}
        assert {k for k in container if k.endswith("Probe")} == set(probes), component
        for kind, path in probes.items():
            probe = container[kind]
            check = probe.get("httpGet") or probe["tcpSocket"]
            assert check["port"] in ports, (component, kind)
            assert check.get("path") == path, (component, kind)
    nginx = (DEPLOY / "nginx.conf").read_text()
    assert any(re.fullmatch(loc, "/v2/health/ready") for loc in re.findall(r"location ~ (\S+)", nginx))
    assert "/health" in {route.path for route in create_app(None).routes}


def test_cpu_and_memory_requests_equal_limits_in_every_pod():
    """Guaranteed pods: Triton sizes its OpenMP team to the cgroup CPU quota the limit sets
    (backends/runtime/threads.py), so a request below the limit would let the node give it
    less than it sized for."""
    for values in (None, OTHER_VALUES):
        docs = render(values)
        workloads = [*objects(docs, "Deployment").values(), *objects(docs, "Job").values()]
        for workload in workloads:
            for container in containers(workload):
                resources = container["resources"]
                assert {"cpu", "memory"} <= set(resources["limits"]), container["name"]
                assert resources["requests"] == resources["limits"], container["name"]
    (triton,) = pod(deployment(render(OTHER_VALUES), "triton"))["containers"]
    assert triton["resources"]["limits"] == {"cpu": "2", "memory": "6Gi", "nvidia.com/gpu": 1}


def test_prometheus_scrapes_each_triton_pod_on_its_metrics_port(docs):
    template = deployment(docs, "triton")["spec"]["template"]
    (container,) = template["spec"]["containers"]
    metrics = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"][0]
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(metrics),
        "prometheus.io/path": scrape["metrics_path"],
    }


def test_the_service_monitor_scrapes_each_triton_pods_metrics_port(docs):
    """Off by default; on, the ServiceMonitor selects the headless metrics Service (by its
    labels, in the release's namespace), whose port of the endpoint's name reaches the Triton
    container's metrics port, on the path Prometheus scrapes in compose."""
    assert not objects(docs, "ServiceMonitor") and f"{RELEASE}-tritonspec-triton-metrics" not in objects(
        docs, "Service"
    )
    docs = render(OTHER_VALUES)
    (monitor,) = objects(docs, "ServiceMonitor").values()
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
    matching = [
        s
        for s in objects(docs, "Service").values()
        if all(s["metadata"]["labels"].get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    ]
    (service,) = matching
    triton = deployment(docs, "triton")
    assert selects(service["spec"]["selector"], triton)
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    (container,) = pod(triton)["containers"]
    assert port["targetPort"] in {p["name"] for p in container["ports"] if p["containerPort"] == 8002}
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"][0]
    assert endpoint["path"] == scrape["metrics_path"]


# ---------------------------------------------------------------------------- scaling


def test_the_hpa_scales_the_triton_deployment_on_the_adapters_metric(docs):
    (hpa,) = objects(docs, "HorizontalPodAutoscaler").values()
    target = hpa["spec"]["scaleTargetRef"]
    triton = objects(docs, target["kind"])[target["name"]]
    assert (target["apiVersion"], triton["apiVersion"]) == ("apps/v1", "apps/v1")
    assert (
        selects(triton["spec"]["selector"]["matchLabels"], triton)
        and "tritonserver" in pod(triton)["containers"][0]["command"]
    )
    # The HPA owns the replica count; a Deployment that also set it would be reset on every upgrade.
    assert "replicas" not in triton["spec"]
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    rule = adapter_rule()
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    # The rule serves the gauge the server exports, per pod.
    series = re.match(r"[\w:]+", rule["seriesQuery"]).group(0)
    assert series == "vllm:num_requests_waiting" and re.fullmatch(rule["name"]["matches"], series)
    assert SERVING_METRICS[series][0] == GAUGE
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"} and "<<.GroupBy>>" in rule["metricsQuery"]
    # Without autoscaling the Deployment has its replica count, and no HPA exists.
    docs = render(OTHER_VALUES)
    assert deployment(docs, "triton")["spec"]["replicas"] == 2 and not objects(docs, "HorizontalPodAutoscaler")


def test_every_deployment_has_a_disruption_budget(docs):
    budgets = objects(docs, "PodDisruptionBudget").values()
    for name, workload in objects(docs, "Deployment").items():
        matching = [b for b in budgets if selects(b["spec"]["selector"]["matchLabels"], workload)]
        assert len(matching) == 1 and matching[0]["spec"]["maxUnavailable"] >= 1, name


# ---------------------------------------------------------------------------- exposure


def test_triton_is_reached_only_through_the_gateway():
    """docs/deployment.md, "What a deployment must not expose": clients get the gateway's
    8000 / 8001 (deploy/nginx.conf's filter) and the OpenAI API's 9000, as compose publishes;
    Triton's own ports stay inside, and its metrics port is behind no Service at all."""
    compose = load_compose("docker-compose.yml")["services"]
    published = {int(p.rsplit(":", 1)[1]) for name in ("lb", "openai") for p in compose[name]["ports"]}
    for values in (None, OTHER_VALUES):
        docs = render(values)
        triton = deployment(docs, "triton")
        services = objects(docs, "Service").values()
        public_ports = set()
        for service in services:
            if service["metadata"]["name"].endswith("-triton-metrics"):  # the ServiceMonitor's: headless, in-cluster
                assert (
                    service["spec"]["clusterIP"] == "None" and service["spec"].get("type", "ClusterIP") == "ClusterIP"
                )
                assert [p["targetPort"] for p in service["spec"]["ports"]] == ["metrics"]
                continue
            assert all(p["targetPort"] != "metrics" and p["port"] != 8002 for p in service["spec"]["ports"])
            if selects(service["spec"]["selector"], triton):
                assert service["spec"]["type"] == "ClusterIP"
                assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "grpc"}
            elif service["metadata"]["name"].endswith("-gateway-internal"):
                # nginx's internal listener, which compose leaves unpublished: in-cluster only.
                assert service["spec"]["type"] == "ClusterIP"
                assert [p["port"] for p in service["spec"]["ports"]] == [8011]
            else:
                public_ports |= {p["port"] for p in service["spec"]["ports"]}
        assert public_ports == published
    # The network policy lets only the gateway's pods reach Triton's API ports.
    docs = render()
    (policy,) = objects(docs, "NetworkPolicy").values()
    assert selects(policy["spec"]["podSelector"]["matchLabels"], deployment(docs, "triton"))
    api, metrics = policy["spec"]["ingress"]
    (source,) = api["from"]
    assert selects(source["podSelector"]["matchLabels"], deployment(docs, "gateway"))
    assert {p["port"] for p in api["ports"]} == {"http", "grpc"} and metrics["ports"] == [{"port": "metrics"}]


def test_the_gateway_runs_the_compose_nginx_conf_against_the_triton_service(docs):
    (config,) = objects(docs, "ConfigMap").values()
    rendered = config["data"]["nginx.conf"]
    triton = objects(docs, "Service")[f"{RELEASE}-tritonspec-triton"]
    name = triton["metadata"]["name"]
    assert rendered == (DEPLOY / "nginx.conf").read_text().replace("server triton:", f"server {name}:")
    upstreams = set(re.findall(r"^\s*server ([\w.-]+):(\d+);", rendered, re.M))
    assert upstreams == {(name, str(p["port"])) for p in triton["spec"]["ports"]}
    gateway = deployment(docs, "gateway")
    listens = {int(p) for p in re.findall(r"listen (\d+);", rendered)}
    assert listens == {p["containerPort"] for p in pod(gateway)["containers"][0]["ports"]}
    (mount,) = pod(gateway)["containers"][0]["volumeMounts"]
    assert (
        mount["mountPath"] == "/etc/nginx/nginx.conf"
        and pod(gateway)["volumes"][0]["configMap"]["name"] == config["metadata"]["name"]
    )


def test_the_openai_front_end_talks_grpc_through_the_gateway(docs):
    (container,) = pod(deployment(docs, "openai"))["containers"]
    assert container["command"][:2] == ["tritonspec", "openai"]
    url = next(a.removeprefix("--url=") for a in container["command"] if a.startswith("--url="))
    # nginx's internal gRPC listener, as compose's openai service uses (it reads model configs).
    gateway = objects(docs, "Service")[f"{RELEASE}-tritonspec-gateway-internal"]
    (grpc,) = [p["port"] for p in gateway["spec"]["ports"]]
    assert url == f"{gateway['metadata']['name']}:{grpc}"
    compose_url = load_compose("docker-compose.yml")["services"]["openai"]["command"]
    assert f"--url=lb:{grpc}" in compose_url
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert ["--host=0.0.0.0", f"--port={port}"] == [
        a for a in container["command"] if a.startswith(("--host", "--port"))
    ]
    # The API key, where one is set, comes from a Secret, never from the values.
    (container,) = pod(deployment(render(OTHER_VALUES), "openai"))["containers"]
    assert container["env"] == [
        {"name": "TRITONSPEC_API_KEY", "valueFrom": {"secretKeyRef": {"name": "openai-key", "key": "api-key"}}}
    ]


# ---------------------------------------------------------------------------- model cache


def test_the_model_is_fetched_into_the_cache_before_triton_starts(docs):
    """As compose's `models` service: one Job (a pre-install hook, after the claim's) writes
    the cache; every Triton pod mounts it read-write, the front end read-only."""
    compose = load_compose("docker-compose.yml")["services"]
    (job,) = objects(docs, "Job").values()
    (claim,) = objects(docs, "PersistentVolumeClaim").values()
    assert pod(job)["containers"][0]["command"] == compose["models"]["command"]
    weight = lambda doc: int(doc["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert "pre-install" in job["metadata"]["annotations"]["helm.sh/hook"] and weight(claim) < weight(job)
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    cache = re.search(r"^ENV TRITONSPEC_CACHE=(\S+)$", (DEPLOY / "Dockerfile").read_text(), re.M).group(1)
    for workload, read_only in ((job, False), (deployment(docs, "triton"), False), (deployment(docs, "openai"), True)):
        (volume,) = [v for v in pod(workload)["volumes"] if v["name"] == "model-cache"]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        (mount,) = [m for m in containers(workload)[-1]["volumeMounts"] if m["name"] == "model-cache"]
        assert mount["mountPath"] == cache and mount.get("readOnly", False) == read_only
    docs = render(OTHER_VALUES)
    assert not objects(docs, "PersistentVolumeClaim")
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for d in objects(docs, "Deployment").values()
        for v in pod(d).get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    assert claims == {"shared-models"}


def test_the_deployment_page_walks_an_operator_through_the_chart():
    page = (ROOT / "docs" / "deployment.md").read_text()
    section = page[page.index("## Kubernetes") :]
    metric = adapter_rule()["name"]["as"]
    for needle in (
        "deploy/k8s",
        "prometheus-adapter-values.yaml",
        "helm install",
        "get hpa",
        "vllm:num_requests_waiting",
        metric,
    ):
        assert needle in section, needle
