"""The Jobs API of the session's `ray start --head` cluster refuses a wrong token. (The
README's `ray job submit` commands run as written in test_readme_run.py.)"""

from __future__ import annotations

import subprocess

from .conftest import ray_cli_path


def test_jobs_api_refuses_a_client_with_a_wrong_token(ray_cluster, tmp_path):
    wrong = tmp_path / "wrong_token"
    wrong.write_text("0" * 32)
    env = {**ray_cluster.client_env, "RAY_AUTH_TOKEN_PATH": str(wrong)}
    result = subprocess.run(
        [ray_cli_path(), "job", "list", "--address", ray_cluster.dashboard_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    # The dashboard answers 403, which Ray's job client reports as an authentication failure.
    assert "Authentication failed: Forbidden: Invalid authentication token" in output, output
    assert (
        "Token authentication is enabled but the authentication token is invalid or incorrect."
        in output
    ), output
    # The same client with the session's token is let in (the refusal is the token's).
    allowed = subprocess.run(
        [ray_cli_path(), "job", "list", "--address", ray_cluster.dashboard_url],
        env=ray_cluster.client_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
