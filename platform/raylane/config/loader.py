"""Load a YAML run configuration, apply `key.path=value` overrides, validate it."""

from __future__ import annotations

import difflib
import json
import types
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from raylane.config.schema import RaylaneConfig

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration problem, worded as one line that names the file and the field."""


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """Turn `["training.epochs=3", ...]` into `{"training.epochs": 3, ...}`.

    Values are parsed as YAML scalars/lists, so `3` is an int, `[64, 64]` a list, `true` a bool.
    """
    overrides: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}': expected KEY.PATH=VALUE, e.g. training.epochs=3")
        try:
            overrides[key] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"override '{item}': value is not valid YAML ({getattr(exc, 'problem', exc)})"
            ) from exc
    return overrides


def _apply_override(tree: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for depth, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parents[: depth + 1])
            raise ConfigError(f"{source}: override '{dotted}': '{where}' is not a section")
        node = child
    node[leaf] = value


def _format_validation_error(
    source: str,
    exc: ValidationError,
    schema: type[BaseModel] = RaylaneConfig,
    overrides: dict[str, str] | None = None,
) -> str:
    """One line: an unknown key an override introduced blames that override (`--set` and its
    text, from `overrides`: dotted key -> `key=value`); every other problem names `source`.
    Unknown keys come with the closest valid keys of their section."""
    blamed, problems = [], []
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            hint = _suggestion(schema, err["loc"])
            override = _override_of(field, overrides or {})
            if override is not None:
                blamed.append(f"--set {override}: unknown key {field}{hint}")
                continue
            message = f"unknown key{hint}"
        problems.append(f"{field}: {message}" if field else message)
    if problems:
        blamed.append(f"{source}: " + "; ".join(problems))
    return "; ".join(blamed)


def _override_of(field: str, overrides: dict[str, str]) -> str | None:
    """The override that put `field` (an unknown key) into the config, if one did."""
    for dotted, text in overrides.items():
        if dotted == field or dotted.startswith(f"{field}."):
            return text
    return None


def _suggestion(schema: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """` (did you mean a.b?)`: the valid keys of the unknown key's section closest to it."""
    models: list[type[BaseModel]] = [schema]
    for part in loc[:-1]:
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        models = [m for f in fields for m in _models_in(f.annotation)]
        if not models:
            return ""
    prefix = "".join(f"{part}." for part in loc[:-1])
    keys = sorted({key for model in models for key in _dotted_keys(model)})
    own = [key for key in keys if "." not in key]  # the section's own keys first, then deeper
    close = difflib.get_close_matches(str(loc[-1]), own, n=3) or difflib.get_close_matches(
        str(loc[-1]), keys, n=3
    )
    return f" (did you mean {' or '.join(prefix + key for key in close)}?)" if close else ""


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field holds: `Section`, `Section | None`, `A | B`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (Union, types.UnionType):
        return [model for arg in get_args(annotation) for model in _models_in(arg)]
    return []


def _dotted_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of `model` and of its sections, dotted: `epochs`, `generation.speculate`..."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        for section in _models_in(field.annotation):
            keys.extend(_dotted_keys(section, f"{prefix}{name}."))
    return keys


def validate_config(
    tree: dict[str, Any],
    source: str = "<config>",
    schema: type[M] = RaylaneConfig,
    overrides: dict[str, str] | None = None,
) -> M:
    """Validate a config mapping; raise ConfigError with a one-line message on failure.

    `overrides` (dotted key -> `key=value` as given) are those applied to `tree`: an unknown
    key one of them introduced is blamed on it rather than on `source`."""
    try:
        return schema.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(source, exc, schema, overrides)) from None


def load_config(
    path: str | Path,
    overrides: dict[str, Any] | list[str] | None = None,
    schema: type[M] = RaylaneConfig,
) -> M:
    """Read `path`, apply overrides, and validate against `schema` (a run config by default).

    Raises:
        ConfigError: the file is missing or unreadable, is not a YAML mapping, or does not
            validate. The message names the file and the field.
    """
    path = Path(path)
    if isinstance(overrides, list):
        texts = {item.partition("=")[0].strip(): item.strip() for item in overrides}
        overrides = parse_overrides(overrides)
    else:
        texts = {
            key: f"{key}={json.dumps(value, default=str)}"
            for key, value in (overrides or {}).items()
        }
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(tree).__name__}")
    for dotted, value in (overrides or {}).items():
        _apply_override(tree, dotted, value, str(path))
    return validate_config(tree, str(path), schema, texts)


def config_to_yaml(config: RaylaneConfig) -> str:
    """The resolved config as YAML: what a run actually used, ready to run again."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def with_absolute_paths(config: RaylaneConfig, base: Path | None = None) -> RaylaneConfig:
    """`config` with its file paths made absolute against `base` (the working directory).

    For configs that run somewhere else than where they were written: a Ray Tune trial runs in
    its own working directory, where a relative data path would point at nothing.
    """
    base = Path.cwd() if base is None else Path(base)

    def absolute(path: Path | None) -> Path | None:
        return None if path is None else (base / path).resolve()

    def absolute_text(path: str) -> str:  # a glob, or a tokenizer.json path ('bytes' stays)
        return path if path == "bytes" or Path(path).is_absolute() else str(base / path)

    tokenizer = config.data.tokenizer
    return config.model_copy(
        update={
            "data": config.data.model_copy(
                update={
                    "train_path": absolute(config.data.train_path),
                    "validation_path": absolute(config.data.validation_path),
                    "files": [absolute_text(f) for f in config.data.files],
                    "tokenizer": absolute_text(tokenizer)
                    if isinstance(tokenizer, str)
                    else tokenizer,
                }
            ),
            "model": config.model.model_copy(
                update={"pretrained": absolute(config.model.pretrained)}
            ),
            "training": config.training.model_copy(
                update={
                    "storage_path": absolute(config.training.storage_path),
                    "resume_from": absolute(config.training.resume_from),
                }
            ),
        }
    )
