import os

import pytest

from raylane.serving.ingress import (
    DRAIN_ENV,
    FAST_INGRESS_ENV,
    LOCAL_DRAIN_S,
    apply_ingress_env,
    export_lines,
    running_ingress,
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in [*FAST_INGRESS_ENV, DRAIN_ENV]:
        monkeypatch.delenv(name, raising=False)


def test_haproxy_sets_serve_variables_for_a_ray_started_here(clean_env):
    apply_ingress_env("haproxy")
    assert {name: os.environ[name] for name in FAST_INGRESS_ENV} == FAST_INGRESS_ENV
    assert running_ingress() == "haproxy"


def test_proxy_turns_haproxy_and_the_throughput_mode_off(clean_env):
    apply_ingress_env("haproxy")
    apply_ingress_env("proxy")
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0"
    assert running_ingress() == "proxy"


def test_a_users_own_setting_wins_over_the_default(clean_env, monkeypatch):
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0")
    apply_ingress_env("haproxy")
    assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0"
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"


def test_a_ray_started_here_drains_stopping_replicas_in_seconds(clean_env, monkeypatch):
    apply_ingress_env("haproxy")
    assert float(os.environ[DRAIN_ENV]) == float(LOCAL_DRAIN_S) <= 5
    monkeypatch.setenv(DRAIN_ENV, "20")  # a user's own period wins
    apply_ingress_env("haproxy")
    assert os.environ[DRAIN_ENV] == "20"


def test_a_cluster_keeps_serves_drain_period():
    # `eval "$(raylane serve-env)"` before `ray start`: an external load balancer may still
    # send traffic to a stopping replica, so Serve's default (30 s) stays.
    assert DRAIN_ENV not in export_lines("haproxy")
