"""The whole path once: prepare -> train -> register -> deploy -> HTTP inference -> shut down."""

from __future__ import annotations

import os

import numpy as np
from rich.console import Console
from rich.table import Table

from raylane.config import RaylaneConfig
from raylane.data import ensure_dataset
from raylane.data.parquet import read_rows
from raylane.runtime import connect_ray, disconnect_ray
from raylane.serving.app import deploy, load_api_key_for, stop_serve
from raylane.serving.ingress import apply_ingress_env
from raylane.serving.leftovers import clear_before_local_serve
from raylane.train.job import run_training


def query_endpoint(
    url: str, model_name: str, rows: np.ndarray, api_key: str | None = None
) -> tuple[list[int], str]:
    """Send rows over real HTTP to the v2 infer route; return predicted labels and version."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {
        "id": "quickstart",
        "inputs": [
            {
                "name": "features",
                "shape": list(rows.shape),
                "datatype": "FP32",
                "data": rows.reshape(-1).tolist(),
            }
        ],
    }
    response = httpx.post(
        f"{url}/v2/models/{model_name}/infer", json=body, headers=headers, timeout=30
    )
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")
    payload = response.json()
    labels = next(o for o in payload["outputs"] if o["name"] == "label")["data"]
    return labels, payload["model_version"]


def run_quickstart(cfg: RaylaneConfig, rows: int, console: Console) -> None:
    console.rule("[1/4] prepare data")
    train_info, val_info = ensure_dataset(cfg)
    console.print(f"{train_info.rows} training and {val_info.rows} validation rows (Parquet)")
    if not os.environ.get("RAY_ADDRESS"):
        clear_before_local_serve(cfg.serving.port)
    started = connect_ray(before_local_start=lambda: apply_ingress_env(cfg.serving.ingress))
    try:
        console.rule(f"[2/4] train ({cfg.parallelism.strategy}, {cfg.parallelism.workers} workers)")
        outcome = run_training(cfg)
        console.print(
            f"val_accuracy {outcome.metrics['val_accuracy']:.4f}; {outcome.promotion}",
            highlight=False,
        )
        console.rule("[3/4] deploy the champion on Ray Serve")
        url, _ = deploy(cfg)
        console.rule("[4/4] inference over HTTP")
        features, truth = read_rows(cfg.data.validation_path, cfg, limit=rows)
        predicted, version = query_endpoint(
            url, cfg.serving.model_name, features, load_api_key_for(cfg)
        )
        table = Table(title=f"{url}/v2/models/{cfg.serving.model_name}/infer (version {version})")
        table.add_column("row", justify="right")
        table.add_column("predicted", justify="right")
        table.add_column("true label", justify="right")
        for index, (guess, label) in enumerate(zip(predicted, truth, strict=True)):
            mark = "" if guess == label else " [red]x[/]"
            table.add_row(str(index), f"{guess}{mark}", str(label))
        console.print(table)
        correct = sum(int(g == t) for g, t in zip(predicted, truth, strict=True))
        console.print(f"{correct}/{len(truth)} correct", highlight=False)
        console.print(f"endpoint (while deployed): {url}  OpenAPI: {url}/docs", highlight=False)
        console.print(f"MLflow UI: mlflow ui --backend-store-uri {outcome.tracking_uri}")
        console.print(f"run: {outcome.run_id}  checkpoint: {outcome.checkpoint_path}")
    finally:
        console.rule("shutting down")
        # a no-op when Ray is not running
        stop_serve(local_ray=started, app_name=cfg.serving.app_name)
        disconnect_ray(started)
