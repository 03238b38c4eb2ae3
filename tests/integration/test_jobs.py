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
    assert result.returncode != 0
    assert "token" in (result.stdout + result.stderr).lower()
