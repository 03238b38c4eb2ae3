"""What `raylane plan` prints and writes: the ranked layouts, what they rest on, the config."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from raylane.config import load_config
from raylane.config.loader import config_to_yaml
from raylane.plan.hardware import Cluster
from raylane.plan.search import Plan, config_overrides


def render(result: Plan, cluster: Cluster, efficiency: float, console: Console, top: int) -> None:
    work, spec, device = result.workload, cluster.spec, cluster.device
    console.print(
        f"{work.shape.total() / 1e9:.2f} B parameters, {work.global_batch} x {work.seq} tokens "
        f"per step, {work.precision}; {spec.nodes} x {spec.devices_per_node} "
        f"{spec.accelerator} ({cluster.devices} devices)",
        highlight=False,
    )
    table = Table(title=f"best {min(top, len(result.ranked))} of {len(result.ranked)} layouts")
    for column in ("#", "layout", "step s", "tokens/s", "TFLOP/s/dev", "memory GB"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for column in ("compute", "bubble", "tp comm", "dp comm", "pp comm"):
        table.add_column(column, justify="right")
    for rank, prediction in enumerate(result.ranked[:top], start=1):
        parts = prediction.parts
        table.add_row(
            str(rank),
            prediction.layout.describe(),
            f"{prediction.step_s:.3f}",
            f"{prediction.tokens_per_s:,.0f}",
            f"{prediction.flops_per_device / 1e12:.1f}",
            f"{prediction.memory_bytes / 1e9:.1f}",
            *(f"{parts[k]:.3f}" for k in ("compute", "bubble", "tp_comm", "dp_comm", "pp_comm")),
        )
    console.print(table)
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


def write_config(base: Path, result: Plan, path: Path) -> Path:
    """The fastest layout as a runnable training config (validated before it is written)."""
    best = result.ranked[0]
    cfg = load_config(base, config_overrides(best, result.workload))
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# raylane plan: {best.layout.describe()} on {best.layout.workers} GPUs, predicted "
        f"{best.step_s:.3f} s per step, {best.memory_bytes / 1e9:.1f} GB per device.\n"
    )
    path.write_text(header + config_to_yaml(cfg))
    return path


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
