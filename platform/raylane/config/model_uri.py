"""A registered model named in a config: `models:/NAME/VERSION` or `models:/NAME@ALIAS`
(MLflow's own model URIs)."""

from __future__ import annotations

import re
from typing import NamedTuple

_URI = re.compile(r"models:/(?P<name>[^/@\s]+)(?:/(?P<version>[1-9]\d*)|@(?P<alias>[\w-]+))")


class ModelRef(NamedTuple):
    name: str
    version: int | None  # None when named by alias
    alias: str  # "" when named by version


def parse_model_uri(uri: str) -> ModelRef:
    """`ModelRef` of `uri`.

    Raises:
        ValueError: `uri` is neither form.
    """
    found = _URI.fullmatch(uri.strip())
    if found is None:
        raise ValueError(f"{uri!r} is not models:/NAME/VERSION or models:/NAME@ALIAS")
    version = found["version"]
    return ModelRef(found["name"], int(version) if version else None, found["alias"] or "")
