"""`raylane validate`: a run config, a search spec, a cluster spec or a hardware catalog,
checked and printed fully resolved."""

from __future__ import annotations

import glob
import sys
from pathlib import Path

import yaml

from raylane.cli.common import DEFAULT_CONFIG, ConfigOption, SetOption, console, fail, load
from raylane.config import ConfigError, RaylaneConfig, load_config
from raylane.config.families import traits
from raylane.config.loader import config_to_yaml
from raylane.plan.hardware import ClusterSpec, HardwareError, catalog_cluster
from raylane.tune.spec import is_search_spec, load_spec

#: Keys that make a YAML file a cluster spec (configs/clusters/) rather than a run config.
CLUSTER_KEYS = frozenset(ClusterSpec.model_fields)


def validate(config: ConfigOption = DEFAULT_CONFIG, overrides: SetOption = None) -> None:
    """Check a config and print it fully resolved (defaults filled in).

    A run config (configs/train/), a search spec (configs/tune/), a cluster spec
    (configs/clusters/) or a hardware catalog (configs/hardware/). The files a run
    config reads must exist: data.files, a 'parquet' source's paths, a tokenizer.

    Example: raylane validate -c configs/train/lm_fsdp.yaml -s training.epochs=3
    """
    tree = _read(config)
    try:
        if is_search_spec(config):
            spec = load_spec(config, overrides or [])
            sys.stdout.write(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
        elif _is_catalog(tree):
            _validate_catalog(config, tree, overrides)
        elif _is_cluster_spec(tree):
            _validate_cluster(config, overrides)
        else:
            cfg = load(config, overrides)
            _check_data_paths(config, cfg)
            if traits(cfg.model.kind).factory:
                # lazy: building the user's module imports torch, which other configs skip
                from raylane.models.custom import check_custom_model

                check_custom_model(cfg)
            sys.stdout.write(config_to_yaml(cfg))
    except (ConfigError, HardwareError) as exc:
        raise fail(str(exc)) from None


def _read(path: Path) -> object:
    """The YAML tree of `path`, or None where the run config loader should say what is wrong."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None


def _is_cluster_spec(tree: object) -> bool:
    return isinstance(tree, dict) and "experiment" not in tree and bool(CLUSTER_KEYS & set(tree))


def _is_catalog(tree: object) -> bool:
    """A hardware catalog: accelerators by name, with their peak FLOP/s."""
    if not isinstance(tree, dict) or "experiment" in tree:
        return False
    return any(isinstance(entry, dict) and "peak_flops" in entry for entry in tree.values())


def _validate_cluster(path: Path, overrides: list[str] | None) -> None:
    """A cluster spec, its accelerator looked up in the catalog `raylane plan` reads."""
    spec = load_config(path, overrides or [], schema=ClusterSpec)
    try:
        cluster = catalog_cluster(spec.accelerator, spec.nodes, spec.devices_per_node)
    except HardwareError as exc:
        raise HardwareError(f"{path}: {exc}") from None
    device = cluster.device
    priced = "priced" if device.pricing is not None else "no prices (no --objective cost)"
    console.print(
        f"{path}: {spec.nodes} x {spec.devices_per_node} {spec.accelerator} ({cluster.devices} "
        f"devices, {device.memory_gb:g} GB each; {priced})",
        highlight=False,
        soft_wrap=True,
    )
    sys.stdout.write(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))


def _validate_catalog(path: Path, tree: dict, overrides: list[str] | None) -> None:
    if overrides:
        raise fail(f"{path}: a hardware catalog takes no --set (edit the file)")
    for name in tree:
        catalog_cluster(name, catalog=path)
    console.print(
        f"{path}: {len(tree)} accelerators: {', '.join(tree)}", highlight=False, soft_wrap=True
    )
    sys.stdout.write(yaml.safe_dump(tree, sort_keys=False))


def _check_data_paths(path: Path, cfg: RaylaneConfig) -> None:
    """The files a run reads that no preparation makes: one `error:` line naming the field."""
    data = cfg.data
    if data.source == "files":
        for index, pattern in enumerate(data.files):
            if not any(Path(found).is_file() for found in glob.glob(pattern, recursive=True)):
                raise fail(f"{path}: data.files[{index}]: {pattern!r} matches no file")
        tokenizer = data.tokenizer if isinstance(data.tokenizer, str) else "bytes"
        if tokenizer != "bytes" and not Path(tokenizer).is_file():
            raise fail(f"{path}: data.tokenizer: {tokenizer} not found")
    if data.source == "parquet":
        for field in ("train_path", "validation_path"):
            if not Path(getattr(data, field)).exists():
                raise fail(f"{path}: data.{field}: {getattr(data, field)} not found")
