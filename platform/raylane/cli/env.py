"""`raylane util runtime-env` and `util serve-env` (also still `raylane runtime-env` and
`serve-env`): the environment a Ray job or a Ray started by hand needs for raylane."""

from __future__ import annotations

from typing import Annotated

import typer

from raylane.cli.common import fail
from raylane.jobs import job_runtime_env_json
from raylane.serving.ingress import export_lines


def runtime_env(
    tracking_uri: Annotated[
        str | None,
        typer.Option(help="MLflow tracking URI for the job (default: as `raylane train` uses)."),
    ] = None,
) -> None:
    """Print the --runtime-env-json for `ray job submit` of a raylane pipeline.

    The tracking store (absolute), the uploaded raylane first on PYTHONPATH, and
    the git commit.

    Example: ray job submit --runtime-env-json "$(raylane util runtime-env)" ...
    """
    print(job_runtime_env_json(tracking_uri))


def serve_env(
    ingress: Annotated[
        str, typer.Option(help="'haproxy' (raylane's default) or 'proxy' (Serve's Python proxy).")
    ] = "haproxy",
) -> None:
    """Print the `export` line that selects Serve's ingress for a Ray started later.

    Run it before `ray start` or `serve run`.

    Example: eval "$(raylane util serve-env)"
    """
    if ingress not in ("haproxy", "proxy"):
        raise fail(f"--ingress must be 'haproxy' or 'proxy', not {ingress!r}")
    print(export_lines(ingress))
