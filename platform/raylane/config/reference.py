"""The configuration reference (README section), generated from the schema's descriptions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from raylane.config.schema import RaylaneConfig

BEGIN = "<!-- config-reference:begin -->"
END = "<!-- config-reference:end -->"


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


def render_into(readme: str) -> str:
    """`readme` with the text between the reference markers replaced by a fresh table."""
    head, _, rest = readme.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{config_reference_markdown()}\n{END}{tail}"


if __name__ == "__main__":
    path = Path("README.md")
    path.write_text(render_into(path.read_text()))
