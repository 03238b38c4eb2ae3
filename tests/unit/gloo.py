"""Run functions on N CPU processes joined in one gloo process group, as a torch.distributed
job's workers would. Each process imports torch (and DDP, FSDP and DTensor load more) once, so
one spawn should serve as many checks as it can:

- `on_gloo(work, world, tmp)` spawns `world` processes, calls `work(rank, world)` in each with
  one torch thread, and returns what each returned, in rank order. A process's exception fails
  the spawn with its traceback.
- A test module's 2-process checks go in its `TWO_PROCESS_CHECKS` (`{name: check(rank, world)}`);
  the unit conftest's `two_processes` fixture runs the checks of every collected module that has
  them in one 2-process spawn, and hands each test its check's per-rank results (or fails it
  with the check's own traceback).
"""

from __future__ import annotations

import datetime
import importlib
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=60)


class CheckFailed(str):
    """A check's traceback, in place of its result."""


def _process(rank: int, work: Callable, world: int, tmp: str, args: tuple) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(tmp) / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        torch.save(work(rank, world, *args), Path(tmp) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def on_gloo(work: Callable[..., object], world: int, tmp: Path, *args) -> list:
    """`work(rank, world, *args)` on `world` processes (a module-level function: it is pickled
    by name); their results in rank order."""
    mp.spawn(_process, args=(work, world, str(tmp), args), nprocs=world, join=True)
    return [torch.load(Path(tmp) / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def run_checks(rank: int, world: int, modules: list[str]) -> dict[tuple[str, str], object]:
    """Every `TWO_PROCESS_CHECKS` entry of `modules`, in turn, on this process: `{(module,
    name): result or CheckFailed}`. Every process runs the same checks in the same order, so
    their collectives meet."""
    results: dict[tuple[str, str], object] = {}
    for module in modules:
        for name, check in importlib.import_module(module).TWO_PROCESS_CHECKS.items():
            try:
                results[module, name] = check(rank, world)
            except Exception:  # noqa: BLE001 - reported by that check's tests
                results[module, name] = CheckFailed(traceback.format_exc())
    return results


def by_rank(two_processes, module: str, names) -> list[dict]:
    """The `two_processes` results of `module`'s checks `names`, as `[{name: result}]` per rank."""
    per_check = {name: two_processes(module, name) for name in names}
    return [{name: found[rank] for name, found in per_check.items()} for rank in range(2)]
