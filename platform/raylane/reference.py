"""The configuration reference (docs/reference/configuration.md), generated from every schema a
user writes: the run config (`raylane train`, `finetune`, `deploy`), the Tune spec
(`raylane tune`), the cluster spec and the hardware catalog (`raylane plan`); and the run
config's JSON Schema for editors (docs/reference/raylane-config.schema.json).

`PYTHONPATH=platform python -m raylane.reference` rewrites both, from the repository root;
the suite fails while either is out of date.
"""

from __future__ import annotations

from raylane.config.reference import (
    JSON_SCHEMA,
    REFERENCE_PAGE,
    config_json_schema_text,
    fields_table,
    render_section,
)
from raylane.config.schema import RaylaneConfig
from raylane.plan.hardware import Accelerator, ClusterSpec
from raylane.tune.spec import TuneSpec

#: The page's sections, by marker name: each schema's table, in the page's order.
SECTIONS = {
    "run": lambda: fields_table(RaylaneConfig),
    "tune": lambda: fields_table(TuneSpec),
    "cluster": lambda: fields_table(ClusterSpec),
    "catalog": lambda: fields_table(Accelerator, "<accelerator>."),
}


def render_page(page: str) -> str:
    """`page` with every section's table generated afresh."""
    for name, table in SECTIONS.items():
        page = render_section(page, name, table())
    return page


def main() -> None:
    REFERENCE_PAGE.write_text(render_page(REFERENCE_PAGE.read_text()))
    JSON_SCHEMA.write_text(config_json_schema_text())


if __name__ == "__main__":
    main()
