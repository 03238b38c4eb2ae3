"""The champion alias moves to a version that beats it, in the direction the metric is better:
a registry in a real MLflow store (SQLite), three versions registered in turn."""

import pytest
from mlflow.tracking import MlflowClient

from raylane.config import load_config
from raylane.tracking.registry import register_if_better

from .test_config import REFERENCE


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    return MlflowClient(f"sqlite:///{tmp_path_factory.mktemp('registry')}/mlflow.db")


@pytest.mark.parametrize(
    ("metric", "goal", "scores", "champions"),
    [
        ("val_accuracy", "auto", [0.80, 0.90, 0.85], [1, 2, 2]),
        ("val_loss", "auto", [1.5, 1.2, 1.3], [1, 2, 2]),  # lower is better
        ("val_loss", "max", [1.5, 1.2, 1.7], [1, 1, 3]),  # as configured, not guessed
        ("val_bits_per_byte", "auto", [2.0, 2.0, 1.9], [1, 1, 3]),  # a tie keeps the champion
    ],
)
def test_the_champion_is_the_best_version_in_the_metrics_direction(
    client, tmp_path, metric, goal, scores, champions
):
    cfg = load_config(
        REFERENCE, [f"tracking.champion_metric={metric}", f"tracking.champion_goal={goal}"]
    )
    name = f"{metric}-{goal}"
    client.create_registered_model(name)
    held = []
    for version, score in enumerate(scores, start=1):
        client.create_model_version(name, f"file://{tmp_path}/v{version}")
        higher = cfg.tracking.champion_higher_is_better
        decision = register_if_better(client, name, version, score, "champion", metric, higher)
        assert decision.promoted == (champions[version - 1] == version)
        held.append(int(client.get_model_version_by_alias(name, "champion").version))
    assert held == champions
