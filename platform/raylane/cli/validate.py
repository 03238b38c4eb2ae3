"""`raylane validate`: a run config or a search spec, checked and printed fully resolved."""

from __future__ import annotations

import sys

import yaml

from raylane.cli.common import DEFAULT_CONFIG, ConfigOption, SetOption, fail, load
from raylane.config import ConfigError
from raylane.config.loader import config_to_yaml
from raylane.tune.spec import is_search_spec, load_spec


def validate(config: ConfigOption = DEFAULT_CONFIG, overrides: SetOption = None) -> None:
    """Check a config, or a search spec (configs/tune/), and print it fully resolved (defaults
    filled in)."""
    if is_search_spec(config):
        try:
            spec = load_spec(config, overrides or [])
        except ConfigError as exc:
            raise fail(str(exc)) from None
        sys.stdout.write(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
        return
    cfg = load(config, overrides)
    sys.stdout.write(config_to_yaml(cfg))
