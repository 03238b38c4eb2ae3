"""The configuration reference, generated from the schema: the documentation site's page of
every field (docs/reference/configuration.md, between its markers) and the run config's JSON
Schema for editors (docs/reference/raylane-config.schema.json).

`PYTHONPATH=platform python -m raylane.config.reference` rewrites both, from the repository root.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from raylane.config.schema import RaylaneConfig

BEGIN = "<!-- config-reference:begin -->"
END = "<!-- config-reference:end -->"
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


def config_reference_markdown() -> str:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | {default} | {text} |" for key, default, text in _fields(RaylaneConfig)]
    return "\n".join(lines)


def render_into(page: str) -> str:
    """`page` with the text between the reference markers replaced by a fresh table."""
    head, _, rest = page.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{config_reference_markdown()}\n{END}{tail}"


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


if __name__ == "__main__":
    REFERENCE_PAGE.write_text(render_into(REFERENCE_PAGE.read_text()))
    JSON_SCHEMA.write_text(config_json_schema_text())
