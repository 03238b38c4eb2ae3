"""`raylane prepare`: a config's dataset materialised as Parquet."""

from __future__ import annotations

from raylane.cli.common import DEFAULT_CONFIG, ConfigOption, SetOption, console, fail, load
from raylane.data import DataError, ensure_dataset


def prepare(config: ConfigOption = DEFAULT_CONFIG, overrides: SetOption = None) -> None:
    """Materialise the config's dataset as Parquet (train and validation splits).

    Example: raylane prepare --config configs/train/lm_fsdp.yaml
    """
    cfg = load(config, overrides)
    try:
        train, validation = ensure_dataset(cfg)
    except DataError as exc:
        raise fail(str(exc)) from None
    console.print(f"train: {train.rows} rows at {train.path}")
    console.print(f"validation: {validation.rows} rows at {validation.path}")
