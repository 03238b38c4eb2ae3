"""Several Serve applications side by side: `serving.app_name` and `serving.route_prefix`,
checked in the config, the refusal before a deploy, the endpoint URL and `raylane status`."""

import io
from pathlib import Path

import pytest
from rich.console import Console

from raylane.config import ConfigError, load_config
from raylane.serving import APP_NAME
from raylane.serving.app import endpoint_url, serve_conflict, undeploy_step
from raylane.serving.errors import route_path
from raylane.serving.status import DeploymentRow, StatusReport, render_status

ROOT = Path(__file__).resolve().parents[2]

DIGITS = ROOT / "configs" / "train" / "digits_ddp.yaml"


def _cfg(*overrides: str):
    return load_config(DIGITS, list(overrides))


def test_defaults_keep_the_one_app_at_the_root():
    serving = _cfg().serving
    assert (serving.app_name, serving.route_prefix) == (APP_NAME, "/") == ("raylane", "/")
    assert endpoint_url(_cfg()) == "http://127.0.0.1:8000"
    lm = _cfg("serving.app_name=lm-2", "serving.route_prefix=/lm/v_2", "serving.host=0.0.0.0")
    assert endpoint_url(lm) == "http://127.0.0.1:8000/lm/v_2"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("serving.app_name=a#b", "'a#b' is not a Serve application name"),
        ("serving.app_name=-lm", "starting with a letter or digit"),
        ("serving.app_name=" + "a" * 64, "1-63 letters"),
        ("serving.route_prefix=lm", "'lm' is not a route prefix"),
        ("serving.route_prefix=/lm/", "no trailing '/'"),
        ("serving.route_prefix=/lm/{id}", "is not a route prefix"),
        ("serving.route_prefix=/lm/..", "'.' or '..'"),
        ("serving.route_prefix=/-/routes", "not Serve's own '/-/'"),
        ("serving.route_prefix=//lm", "is not a route prefix"),
    ],
)
def test_unsafe_names_and_prefixes_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError, match="digits_ddp.yaml: serving.") as caught:
        _cfg(override)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def _details(port=8000, **apps):
    """Serve's self-description as `serve_details` returns it: {name: (prefix, status)}."""
    applications = {
        name: {"route_prefix": prefix, "status": status} for name, (prefix, status) in apps.items()
    }
    return {"http_options": {"port": port}, "applications": applications}


def test_a_second_app_needs_a_prefix_of_its_own_on_serves_port():
    lm = _cfg("serving.app_name=lm")
    assert serve_conflict(lm, None) is None  # Serve not running yet
    assert serve_conflict(lm, _details()) is None  # running, no application
    taken = serve_conflict(lm, _details(raylane=("/", "RUNNING")))
    assert taken == (
        "serving.route_prefix '/' is held by the running Serve application 'raylane': give "
        "application 'lm' a prefix of its own (e.g. --set serving.route_prefix=/lm)"
    )
    beside = _cfg("serving.app_name=lm", "serving.route_prefix=/lm")
    assert serve_conflict(beside, _details(raylane=("/", "RUNNING"))) is None
    # Its own application rolls in place (any prefix); a deleting application frees its prefix.
    assert serve_conflict(_cfg(), _details(raylane=("/", "RUNNING"))) is None
    assert (
        serve_conflict(_cfg("serving.route_prefix=/d"), _details(raylane=("/", "RUNNING"))) is None
    )
    assert serve_conflict(lm, _details(raylane=("/", "DELETING"))) is None
    other = serve_conflict(beside, _details(port=8001, raylane=("/", "RUNNING")))
    assert other == (
        "Serve on this cluster listens on port 8001, not serving.port 8000: its applications "
        "share that port (--set serving.port=8001)"
    )
    assert serve_conflict(beside, {"applications": {}}) is None  # Serve's default port 8000


def _rendered(report: StatusReport) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(render_status(report))
    return console.file.getvalue()


def test_status_shows_every_app_with_its_prefix_and_the_alias_for_the_configs_own():
    rows = [
        DeploymentRow("raylane", "RUNNING", "model", "HEALTHY", {"RUNNING": 1}, {2}, route="/"),
        DeploymentRow(
            "lm",
            "RUNNING",
            "generator",
            "HEALTHY",
            {"RUNNING": 1},
            {7},
            {"generate: 8 slots"},
            route="/lm",
        ),  # fmt: skip
    ]
    text = _rendered(StatusReport(rows, "champion", 3, "raylane", "raylane-digits"))
    assert "registry alias raylane-digits@champion -> v3" in text
    (digits,) = [line for line in text.splitlines() if "raylane " in line and "model" in line]
    assert "v2 (alias moved" in digits  # the config's application, behind its alias
    (lm,) = [line for line in text.splitlines() if "lm at /lm" in line]
    assert "v7 (generate: 8 slots)" in lm and "alias moved" not in lm  # another model's app


def test_middlewares_see_the_path_within_the_application():
    assert route_path({"path": "/digits/v2/health/ready", "root_path": "/digits"}) == (
        "/v2/health/ready"
    )
    assert route_path({"path": "/digits", "root_path": "/digits"}) == "/"
    assert route_path({"path": "/v1/models", "root_path": ""}) == "/v1/models"
    assert route_path({"path": "/v1/models"}) == "/v1/models"


@pytest.mark.parametrize(
    ("apps", "step"),
    [
        (None, None),  # no Serve controller: nothing to remove
        ([], "shutdown"),  # Serve with no application left: it goes
        (["digits"], "shutdown"),  # the last application: Serve goes with it
        (["digits", "raylane"], "delete"),  # the others keep serving
        (["raylane"], None),  # not running here: the other is left alone
    ],
)
def test_undeploy_removes_the_app_and_serve_only_with_its_last_app(apps, step):
    details = None if apps is None else {"applications": {name: {} for name in apps}}
    assert undeploy_step("digits", details) == step
