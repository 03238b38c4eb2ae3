"""The configuration reference's parts, generated from a schema: a table of every field of a
pydantic model (its key, default and description), the page's sections between their markers,
and the run config's JSON Schema for editors (docs/reference/raylane-config.schema.json).

`raylane.reference` puts every schema a user writes on the page (docs/reference/
configuration.md): `PYTHONPATH=platform python -m raylane.reference` rewrites both files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from raylane.config.schema import RaylaneConfig

REFERENCE_PAGE = Path("docs/reference/configuration.md")
JSON_SCHEMA = Path("docs/reference/raylane-config.schema.json")


def _fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str, str]]:
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _fields(annotation, f"{prefix}{name}.")
            continue
        default = field.get_default(call_default_factory=True)
        if default is PydanticUndefined:
            shown = "required"
        elif isinstance(default, Path):
            shown = f"`{default}`"
        else:
            shown = f"`{default!r}`".replace("|", "\\|")
        yield f"{prefix}{name}", shown, (field.description or "").replace("|", "\\|")


def fields_table(model: type[BaseModel], prefix: str = "") -> str:
    """Every field of `model` (nested models flattened to dotted keys under `prefix`) as a
    markdown table: key, default, meaning."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | {default} | {text} |" for key, default, text in _fields(model, prefix)]
    return "\n".join(lines)


def render_section(page: str, name: str, text: str) -> str:
    """`page` with the text between section `name`'s markers replaced by `text`."""
    begin, end = f"<!-- config-reference:{name}:begin -->", f"<!-- config-reference:{name}:end -->"
    if begin not in page or end not in page:
        raise ValueError(f"{REFERENCE_PAGE} has no {begin} ... {end} markers")
    head, _, rest = page.partition(begin)
    _, _, tail = rest.partition(end)
    return f"{head}{begin}\n{text}\n{end}{tail}"


def config_json_schema() -> dict[str, Any]:
    """The run config as JSON Schema (draft 2020-12), as pydantic describes it, plus what a
    before-validator accepts and pydantic cannot see: `parallelism.workers` as an elastic range
    `{min, max}` (stored as `workers: max, min_workers: min`)."""
    schema = RaylaneConfig.model_json_schema()
    workers = schema["$defs"]["ParallelismConfig"]["properties"]["workers"]
    count = {k: workers.pop(k) for k in ("type", "minimum") if k in workers}
    elastic = {
        "type": "object",
        "properties": {"min": count, "max": count},
        "required": ["min", "max"],
        "additionalProperties": False,
    }
    workers["anyOf"] = [count, elastic]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def config_json_schema_text() -> str:
    return json.dumps(config_json_schema(), indent=2, ensure_ascii=False) + "\n"
