import os

import pytest

from raylane.serving.ingress import FAST_INGRESS_ENV, apply_ingress_env, running_ingress


@pytest.fixture
def clean_env(monkeypatch):
    for name in FAST_INGRESS_ENV:
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
