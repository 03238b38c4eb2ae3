"""What `raylane plan` prints and writes: the ranked layouts, what they rest on, the config."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import yaml
from rich import box
from rich.console import Console
from rich.table import Table

from raylane.config import ConfigError, RaylaneConfig, load_config
from raylane.config.loader import flatten, validate_config
from raylane.plan.hardware import Cluster
from raylane.plan.pricing import LayoutCost
from raylane.plan.search import Plan, config_overrides

#: The step's parts, as columns: compute, then what each parallel axis adds.
_PARTS = ("compute", "bubble", "tp_comm", "dp_comm", "pp_comm", "cp_comm")


def render(result: Plan, cluster: Cluster, efficiency: float, console: Console, top: int) -> None:
    _print_workload(result, cluster, console)
    shown = result.ranked[:top]
    table = _narrow_table(
        f"best {len(shown)} of {len(result.ranked)} layouts",
        "#", "layout", "step\ns", "tokens\n/s", "TFLOP/s\n/device", "memory\nGB", "activ.\nGB",
    )  # fmt: skip
    for rank, prediction in enumerate(shown, start=1):
        table.add_row(
            str(rank),
            prediction.layout.describe(),
            f"{prediction.step_s:.3f}",
            f"{prediction.tokens_per_s:,.0f}",
            f"{prediction.flops_per_device / 1e12:.1f}",
            f"{prediction.memory_bytes / 1e9:.1f}",
            f"{prediction.activation_bytes / 1e9:.1f}",
        )
    console.print(table)
    parts = _narrow_table("where each step goes, s", "#", *(p.replace("_", " ") for p in _PARTS))
    for rank, prediction in enumerate(shown, start=1):
        parts.add_row(str(rank), *(f"{prediction.parts[k]:.3f}" for k in _PARTS))
    console.print(parts)
    _print_basis(result, cluster, efficiency, console)


def _narrow_table(title: str, *columns: str) -> Table:
    """A table for 80 columns: a rule under the header, no frame; only `layout` may wrap (at
    its spaces), every other column keeps its figures whole."""
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), show_edge=False)
    for column in columns:
        wraps = column in ("layout", "capacity")
        table.add_column(column, justify="left" if wraps else "right", no_wrap=not wraps)
    return table


def _print_workload(result: Plan, cluster: Cluster, console: Console) -> None:
    work, spec = result.workload, cluster.spec
    console.print(
        f"{work.shape.total() / 1e9:.2f} B parameters, {work.global_batch} x {work.seq} tokens "
        f"per step, {work.precision}; {spec.nodes} x {spec.devices_per_node} "
        f"{spec.accelerator} ({cluster.devices} devices)",
        highlight=False,
    )


def _print_basis(result: Plan, cluster: Cluster, efficiency: float, console: Console) -> None:
    """What did not fit, and what the predictions rest on."""
    work, spec, device = result.workload, cluster.spec, cluster.device
    if result.pruned:
        layout, reason = min(result.pruned, key=lambda pair: pair[0].workers)
        console.print(
            f"pruned {len(result.pruned)} layouts that do not fit, e.g. "
            f"{layout.describe()}: {reason}",
            highlight=False,
        )
    console.print(
        f"basis: {cluster.basis} figures for {spec.accelerator} (peak "
        f"{device.peak_flops[work.precision] / 1e12:g} TFLOP/s {work.precision}, "
        f"{device.memory_gb:g} GB, links {device.intra_node_gbps:g} GB/s in a node and "
        f"{device.inter_node_gbps:g} GB/s between nodes) and the assumption that matrix "
        f"multiplications reach {efficiency:.0%} of peak; nothing here was measured on that "
        "cluster.",
        highlight=False,
    )


def render_costs(
    result: Plan, cluster: Cluster, efficiency: float, console: Console, top: int,
    epoch_source: str,
) -> None:  # fmt: skip
    """The layouts ranked by expected cost per epoch, the recommendation and its figures."""
    _print_workload(result, cluster, console)
    nodes, shown = cluster.spec.nodes, result.ranked[:top]
    table = _narrow_table(
        f"cheapest {len(shown)} of {len(result.ranked)} layouts on 1 to {nodes} "
        f"node{'s' if nodes > 1 else ''}",
        "#", "layout", "nodes", "step\ns", "memory\nGB", "hours\n/epoch",
    )  # fmt: skip
    prices = _narrow_table(
        "cost per epoch", "#", "on demand", "spot", "per M\ntokens", "capacity",
        "checkpoint\nevery",
    )  # fmt: skip
    for rank, prediction in enumerate(shown, start=1):
        cost = result.costs[prediction.layout]
        table.add_row(
            str(rank),
            prediction.layout.describe(),
            str(cost.nodes),
            f"{prediction.step_s:.3f}",
            f"{prediction.memory_bytes / 1e9:.1f}",
            _hours(cost.on_demand.hours),
        )
        prices.add_row(
            str(rank),
            _usd(cost.on_demand.usd),
            _usd(cost.spot.usd),
            _usd(cost.usd_per_million_tokens(cost.best)),
            cost.best.name,
            _interval(cost, prediction.step_s) if cost.best is cost.spot else "-",
        )
    console.print(table)
    console.print(prices)
    best = result.ranked[0]
    for line in _recommendation(result.costs[best.layout], best.layout.describe(), best.step_s):
        console.print(line, highlight=False)
    work = result.workload
    console.print(
        f"epoch: {result.terms.epoch_tokens:,.0f} tokens ({epoch_source}), "
        f"{result.terms.epoch_tokens / (work.global_batch * work.seq):,.1f} steps",
        highlight=False,
    )
    pricing = cluster.device.pricing
    console.print(
        f"prices per device-hour for {cluster.spec.accelerator}: "
        f"${pricing.on_demand_usd_per_hour:g} on demand, ${pricing.spot_usd_per_hour:g} spot, "
        f"{pricing.spot_interruptions_per_node_hour:g} spot preemptions per node-hour; "
        f"source: {pricing.source}",
        highlight=False,
    )
    _print_basis(result, cluster, efficiency, console)


def _recommendation(cost: LayoutCost, layout: str, step_s: float) -> list[str]:
    best, other = cost.best, cost.other
    lines = [
        f"recommended: {best.name} capacity for {layout} on {cost.nodes} node"
        f"{'s' if cost.nodes > 1 else ''}: {_usd(best.usd)} per epoch, "
        f"{cost.saving:.0%} less than {other.name} ({_usd(other.usd)}); "
        f"{_usd(cost.usd_per_million_tokens(best))} per million tokens"
    ]
    if cost.optimum_s is None:
        return [*lines, "spot: no preemptions expected (rate 0), so no checkpoints are needed"]
    overhead = cost.spot.hours / cost.on_demand.hours - 1
    lines.append(
        f"spot: {cost.rate_per_hour:g} preemptions per hour on {cost.nodes} node"
        f"{'s' if cost.nodes > 1 else ''}; checkpoint every {_interval(cost, step_s)}: "
        f"Young's interval {cost.young_s / 60:.1f} min, Daly's optimum "
        f"{cost.optimum_s / 60:.1f} min, for {cost.checkpoint_s:.0f} s per checkpoint and "
        f"{cost.restart_s:.0f} s per restart; {overhead:.1%} expected overhead"
    )
    if best is not cost.spot:
        return lines  # on demand: the written config keeps per-epoch checkpoints
    return [
        *lines,
        "the written config checkpoints at that interval (training.checkpoint_every_steps)",
    ]


def cost_notes(cost: LayoutCost) -> list[str]:
    """The recommendation as comment lines for a written config."""
    best = cost.best
    lines = [
        f"raylane plan --objective cost: {best.name} capacity, expected {_usd(best.usd)} per "
        f"epoch ({cost.other.name}: {_usd(cost.other.usd)})."
    ]
    if best is cost.spot and cost.checkpoint_steps is not None:
        lines.append(
            f"On spot, a checkpoint every {cost.checkpoint_steps} steps minimises the expected "
            "cost (training.checkpoint_every_steps)."
        )
    return lines


def _interval(cost: LayoutCost, step_s: float) -> str:
    if cost.checkpoint_steps is None:
        return "-"
    return f"{cost.checkpoint_steps} steps, {cost.checkpoint_steps * step_s / 60:.1f} min"


def _usd(amount: float) -> str:
    if math.isinf(amount):
        return "unbounded"
    if amount >= 100:
        return f"${amount:,.0f}"
    return f"${amount:.2f}" if amount >= 1 else f"${amount:#.3g}"


def _hours(hours: float) -> str:
    return f"{hours:,.1f}" if hours >= 10 else f"{hours:#.3g}"


def write_config(base: Path, result: Plan, path: Path, overrides: list[str] | None = None) -> Path:
    """The first-ranked layout as a runnable training config: `base` with its `overrides` and
    the layout's, validated, written as the fields that differ from the defaults (and the
    precision the prediction assumed). Ranked by cost, its header also says which capacity
    and checkpoint interval."""
    overrides = overrides or []
    best = result.ranked[0]
    cost = result.costs.get(best.layout)
    steps = cost.checkpoint_steps if cost and cost.best is cost.spot else None
    cfg = load_config(base, [*overrides, *config_overrides(best, result.workload, steps)])
    if cfg.parallelism.dims.mesh_shape() != best.layout.dims.mesh_shape():  # the planned one
        raise ConfigError(
            f"the written config runs {cfg.parallelism.dims.describe()}, not the planned "
            f"{best.layout.dims.describe()}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# raylane plan: {best.layout.describe()} on {best.layout.workers} GPUs, predicted "
        f"{best.step_s:.3f} s per step, {best.memory_bytes / 1e9:.1f} GB per device.\n"
    )
    if cost is not None:
        header += "".join(f"# {line}\n" for line in cost_notes(cost))
    sets = "".join(f" --set {item}" for item in overrides)
    header += (
        f"# Planned from {base}{sets}.\n# Fields at their defaults are left out, except the "
        "layout's and the precision planned for.\n"
    )
    written = changed_from_defaults(cfg, keep=(*KEPT, "training.precision"))
    path.write_text(header + yaml.safe_dump(written, sort_keys=False))
    return path


#: Written even at their defaults: the layout a config is about, and the keys that decide
#: what its degrees mean.
KEPT = ("experiment", "parallelism.strategy", "parallelism.workers")


def changed_from_defaults(cfg: RaylaneConfig, keep: tuple[str, ...] = KEPT) -> dict[str, Any]:
    """The fields of `cfg` that differ from their defaults, those named in `keep`, and any
    other field without which it would not load the same (a default another field decides):
    a short YAML tree that validates back to `cfg`."""
    full = cfg.model_dump(mode="json")
    wanted = flatten(full)
    tree = _without_empty(cfg.model_dump(mode="json", exclude_defaults=True))
    for key in keep:
        _put(tree, key, wanted[key])
    missing = _differences(tree, wanted)
    if missing:  # the fields themselves first, then their whole sections
        for key in missing:
            _put(tree, key, wanted[key])
        sections = {key.split(".")[0] for key in missing}
        if _differences(tree, wanted) != []:
            tree.update({section: full[section] for section in sections})
    return tree if _differences(tree, wanted) == [] else full


def _differences(tree: dict[str, Any], wanted: dict[str, Any]) -> list[str] | None:
    """The keys whose values `tree` does not load to (None: it does not validate)."""
    try:
        got = flatten(validate_config(copy.deepcopy(tree)).model_dump(mode="json"))
    except ConfigError:
        return None
    return [key for key, value in wanted.items() if got.get(key) != value]


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _without_empty(tree: dict[str, Any]) -> dict[str, Any]:
    """`tree` without its empty sections (all their fields at the defaults)."""
    kept = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            value = _without_empty(value)
        if value != {}:
            kept[key] = value
    return kept


def render_profile(found: dict, reused: bool, console: Console) -> None:
    """The profile's figures, one column per worker count measured."""
    how = "reused" if reused else "measured"
    levels = sorted(found["levels"], key=int)
    table = Table(title=f"profile at {', '.join(levels)} workers at a time ({how})")
    table.add_column("figure")
    for k in levels:
        table.add_column(f"{k} worker{'s' if k != '1' else ''}", justify="right")

    def row(label: str, cell) -> None:
        table.add_row(label, *(cell(found["levels"][k]) for k in levels))

    for rows in sorted(found["levels"][levels[0]]["block_s"], key=int):
        row(f"one block, forward + backward, {rows} rows",
            lambda level, rows=rows: f"{level['block_s'][rows] * 1e3:.2f} ms")  # fmt: skip
    row("ends (embeddings, head, loss), per row",
        lambda level: f"{level['ends']['per_row_s'] * 1e3:.3f} ms")  # fmt: skip
    row("optimizer step, per million parameters",
        lambda level: f"{level['optimizer_s_per_param'] * 1e9:.1f} ms")  # fmt: skip
    row("all-reduce: alpha, 1/beta", lambda level: _link(level.get("all_reduce")))
    row("DDP wait after the last bucket, 8 rows",
        lambda level: _seconds(level.get("ddp_wait"), 8))  # fmt: skip
    for name in ("gpipe", "1f1b"):

        def schedule(level, name=name) -> str:
            return _seconds(level.get("schedules", {}).get(name), 1, slope=True)

        row(f"{name} schedule cost per micro-batch", schedule)
    table.add_row(
        "point-to-point: alpha, 1/beta", _link(found.get("p2p")), *[""] * (len(levels) - 1)
    )
    table.add_row(
        "activations saved per row: block, ends",
        f"{found['block_activation_bytes_per_row'] / 2**10:.0f} KiB, "
        f"{found['ends_activation_bytes_per_row'] / 2**10:.0f} KiB",
        *[""] * (len(levels) - 1),
    )
    table.add_row("worker baseline memory", f"{found['baseline_rss_mb']:.0f} MB",
                  *[""] * (len(levels) - 1))  # fmt: skip
    console.print(table)


def _link(fit: dict | None) -> str:
    if fit is None:
        return "-"
    beta = fit["beta_s_per_byte"]
    bandwidth = f"{1 / beta / 1e9:.2f} GB/s" if beta > 0 else "not measurable"
    return f"{fit['alpha_s'] * 1e6:.0f} us, {bandwidth}"


def _seconds(fit: dict | None, x: float, slope: bool = False) -> str:
    if fit is None:
        return "-"
    seconds = fit["per_row_s"] * x if slope else fit["fixed_s"] + fit["per_row_s"] * x
    return f"{seconds * 1e3:.2f} ms"
