"""Validated run configuration: pydantic schema plus a YAML loader with dotted overrides."""

from raylane.config.loader import ConfigError, load_config, parse_overrides
from raylane.config.schema import (
    DataConfig,
    ModelConfig,
    ParallelismConfig,
    RaylaneConfig,
    ServingConfig,
    TrackingConfig,
    TrainingConfig,
)

__all__ = [
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "ParallelismConfig",
    "RaylaneConfig",
    "ServingConfig",
    "TrackingConfig",
    "TrainingConfig",
    "load_config",
    "parse_overrides",
]
