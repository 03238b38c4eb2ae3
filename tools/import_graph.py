"""The import graph of raylane's modules as a Mermaid diagram (GitHub renders it), from the
same static analysis the layering contract runs on (grimp, under import-linter).

    python tools/import_graph.py                      # the parallel layout and what reads it
    python tools/import_graph.py --packages serving

One box per module, grouped by package; an arrow `a --> b` where module a imports b (at the
top or inside a function: a lazy import is still a dependency). `--packages` picks the
subpackages drawn (default: the layout type, the parallelisms and their readers).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import grimp

#: The layout and everything that applies or reads it.
LAYOUT = ["config.presets", "config.dims", "config.layout", "models.gpt_plan", "parallel",
          "train.loop", "plan.cost", "plan.measured", "plan.search", "plan.wrapped",
          "profile.layouts", "tune.candidates"]  # fmt: skip


def _selected(module: str, wanted: list[str]) -> bool:
    name = module.removeprefix("raylane.")
    return any(name == w or name.startswith(w + ".") for w in wanted)


def mermaid(wanted: list[str]) -> str:
    graph = grimp.build_graph("raylane", exclude_type_checking_imports=True)
    modules = sorted(m for m in graph.modules if _selected(m, wanted) and m != "raylane")
    groups: dict[str, list[str]] = defaultdict(list)
    for module in modules:
        groups[module.split(".")[1] if module.count(".") else module].append(module)
    lines = ["flowchart LR"]
    for package, members in sorted(groups.items()):
        lines.append(f"  subgraph {package}")
        lines += [f"    {m.replace('.', '_')}[{m.removeprefix('raylane.')}]" for m in members]
        lines.append("  end")
    for module in modules:
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported in modules and imported != module:
                lines.append(f"  {module.replace('.', '_')} --> {imported.replace('.', '_')}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packages", nargs="+", default=LAYOUT)
    print(mermaid(parser.parse_args().packages))


if __name__ == "__main__":
    main()
