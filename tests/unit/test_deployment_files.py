"""docker-compose.yml and the Dockerfile, checked offline (no Docker engine runs here)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_matches_the_compose_specification():
    tool = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))
    assert tool, "check-jsonschema is a dev dependency"
    result = subprocess.run(
        [tool, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_services_depend_on_health_checks(compose):
    services = compose["services"]
    assert set(services) == {"postgres", "mlflow", "ray-head", "ray-worker"}
    for name in ("postgres", "mlflow", "ray-head"):
        assert "healthcheck" in services[name], name
    assert services["mlflow"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["ray-head"]["depends_on"]["mlflow"]["condition"] == "service_healthy"
    assert services["ray-worker"]["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert "ray-head:6379" in services["ray-worker"]["command"]


def test_published_ports_bind_loopback_only(compose):
    published = [
        port for service in compose["services"].values() for port in service.get("ports", [])
    ]
    assert sorted(published) == [
        "127.0.0.1:5000:5000",
        "127.0.0.1:8000:8000",
        "127.0.0.1:8265:8265",
    ]


def test_token_auth_is_on_and_no_secret_is_committed(compose):
    text = COMPOSE.read_text()
    for name in ("ray-head", "ray-worker"):
        env = compose["services"][name]["environment"]
        assert env["RAY_AUTH_MODE"] == "token"
        assert env["RAY_AUTH_TOKEN"].startswith("${RAY_AUTH_TOKEN:?")
    assert "${POSTGRES_PASSWORD:?" in text
    gitignore = (ROOT / ".gitignore").read_text().splitlines()
    assert ".env" in gitignore
    example = dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert example == {"RAY_AUTH_TOKEN": "", "POSTGRES_PASSWORD": "", "RAYLANE_API_KEY": ""}
    # The API key is optional (empty: no key), never a committed value.
    assert compose["services"]["ray-head"]["environment"]["RAYLANE_API_KEY"] == (
        "${RAYLANE_API_KEY:-}"
    )


def test_mlflow_server_is_locked_to_known_hosts_on_a_sql_backend(compose):
    command = compose["services"]["mlflow"]["command"]
    assert "--backend-store-uri postgresql://" in command
    assert "--allowed-hosts mlflow" in command
    assert compose["services"]["postgres"]["volumes"]


def test_dockerfile_installs_the_project_and_the_files_it_copies_exist():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install torch==2.13.0" in dockerfile
    assert "pip install -e ." in dockerfile
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source


K8S = ROOT / "configs" / "k8s"


def _pod_specs(cluster: dict) -> list[dict]:
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [group["template"]["spec"] for group in groups]


@pytest.mark.parametrize(
    ("name", "kind", "cluster_key"),
    [("rayjob.yaml", "RayJob", "rayClusterSpec"), ("rayservice.yaml", "RayService",
                                                   "rayClusterConfig")],
)  # fmt: skip
def test_kuberay_manifests_use_the_raylane_image_and_token_auth(name, kind, cluster_key):
    manifest = yaml.safe_load((K8S / name).read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == kind
    cluster = manifest["spec"][cluster_key]
    assert cluster["rayVersion"].startswith("2.60")
    for pod in _pod_specs(cluster):
        (container,) = pod["containers"]
        assert container["image"] == "raylane:latest"
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"]


def test_rayjob_runs_a_raylane_pipeline_with_a_shipped_config():
    spec = yaml.safe_load((K8S / "rayjob.yaml").read_text())["spec"]
    words = spec["entrypoint"].split()
    assert words[:2] == ["python", "pipelines/train.py"]
    assert (ROOT / words[1]).is_file()
    assert (ROOT / words[words.index("--config") + 1]).is_file()


def test_rayservice_serves_the_same_application_as_serving_config():
    spec = yaml.safe_load((K8S / "rayservice.yaml").read_text())["spec"]
    in_k8s = yaml.safe_load(spec["serveConfigV2"])
    local = yaml.safe_load((ROOT / "serving" / "config.yaml").read_text())
    (app_k8s,), (app_local,) = in_k8s["applications"], local["applications"]
    for key in ("name", "route_prefix", "import_path"):
        assert app_k8s[key] == app_local[key]
    assert app_k8s["args"]["config"] == app_local["args"]["config"]
    assert in_k8s["http_options"]["port"] == local["http_options"]["port"]
    # Inside a pod the proxy must listen beyond loopback; the Service decides exposure.
    assert in_k8s["http_options"]["host"] == "0.0.0.0"
    assert local["http_options"]["host"] == "127.0.0.1"


def test_clusters_start_serve_with_the_default_fast_ingress(compose):
    from raylane.config.schema import ServingConfig
    from raylane.serving.ingress import ingress_env

    assert ServingConfig().ingress == "haproxy"
    wanted = ingress_env("haproxy")
    for name in ("ray-head", "ray-worker"):
        env = compose["services"][name]["environment"]
        assert {key: env.get(key) for key in wanted} == wanted, name
    cluster = yaml.safe_load((K8S / "rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    for pod in _pod_specs(cluster):
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert {key: env.get(key) for key in wanted} == wanted
