"""One Tune trial: a short, real Ray Train job of one candidate layout."""

from __future__ import annotations

from typing import Any

from raylane.config import RaylaneConfig
from raylane.data.ray_datasets import read_datasets
from raylane.train.trainer import build_trainer


def trial_driver(trial: dict[str, Any], configs: dict[str, dict[str, Any]]) -> None:
    """Tune function trainable: build and fit the candidate's TorchTrainer.

    `trial["key"]` names the layout; `configs` maps every key to its resolved config.

    Train V2 refuses Tune callbacks in its RunConfig; `TuneReportCallback` (a Train user
    callback) forwards each epoch's report to this trial instead.
    """
    import uuid

    from ray.tune.integration.ray_train import TuneReportCallback

    cfg = RaylaneConfig.model_validate(configs[trial["key"]])
    trainer = build_trainer(
        cfg,
        read_datasets(cfg),
        run_name=f"trial-{trial['key']}-{uuid.uuid4().hex[:6]}",
        callbacks=[TuneReportCallback()],
    )
    trainer.fit()
