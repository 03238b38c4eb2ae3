"""Enumerate the layouts of a search space: valid ones to launch, pruned ones with a reason.

Validity is decided by the training config's own validators (one source of truth for what a
layout may be) plus the search's resource budget; nothing infeasible is ever launched.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from raylane.config import ConfigError, RaylaneConfig, load_config
from raylane.config.loader import with_absolute_paths
from raylane.config.presets import PRESETS
from raylane.tune.spec import TuneSpec


@dataclass(frozen=True)
class Candidate:
    """One layout: the overrides that turn the base config into it."""

    overrides: dict[str, Any]

    @property
    def key(self) -> str:
        o = self.overrides
        parts = [
            o["parallelism.strategy"],
            f"w{o['parallelism.workers']}",
            f"dp{o['parallelism.dp']}xpp{o['parallelism.pp']}",
            *([f"tp{o['parallelism.tp']}"] if o.get("parallelism.tp", 1) > 1 else []),
            *([f"cp{o['parallelism.cp']}"] if o.get("parallelism.cp", 1) > 1 else []),
            *(["sp"] if o.get("parallelism.sequence_parallel") else []),
            f"m{o['parallelism.microbatches']}",
            f"b{o['training.batch_size']}",
        ]
        if o["parallelism.grad_compression"] != "none":
            parts.append(o["parallelism.grad_compression"])
        if o["training.activation_checkpointing"]:
            parts.append("ac")
        parts += [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in o.items() if k not in _LAYOUT_KEYS]
        return "-".join(str(p) for p in parts)

    def as_list(self) -> list[str]:
        return [f"{k}={_yaml_value(v)}" for k, v in self.overrides.items()]


# What each trial's Tune function reserves while it waits on its Train workers: a sliver, so
# the workers can start, but it counts against the budget (a full budget would deadlock).
TRIAL_DRIVER_CPU = 0.01


@dataclass(frozen=True)
class Pruned:
    candidate: Candidate
    reason: str


_LAYOUT_KEYS = {
    "parallelism.strategy",
    "parallelism.workers",
    "parallelism.dp",
    "parallelism.pp",
    "parallelism.tp",
    "parallelism.cp",
    "parallelism.sequence_parallel",
    "parallelism.microbatches",
    "training.batch_size",
    "parallelism.grad_compression",
    "training.activation_checkpointing",
    "parallelism.resources_per_worker",
}


def _yaml_value(value: Any) -> str:
    import json

    return "null" if value is None else json.dumps(value)


def _layouts(
    strategy: str, workers: int, pps: list[int], tps: list[int], cps: list[int]
) -> list[tuple[int, int, int, int]]:
    """(dp, pp, tp, cp) per layout of `strategy` on `workers`, within the degrees its preset
    takes; an impossible one is kept so that the config's validation names why it is pruned.
    A name that needs stages takes every pp of the space (tp 1); one that may have them
    (FSDP) also shards each stage over its dp workers; sequences are split over cp workers
    where the preset splits them."""
    preset = PRESETS[strategy]
    staged = [(workers // pp, pp, 1, 1) for pp in pps if pp > 1 and workers % pp == 0]
    if preset.needs_stages:
        return staged or [(workers, 1, 1, 1)]
    tp_options = [1]  # names that split blocks: those of the space (and 1 where optional)
    if preset.takes_tp:
        tp_options = tps if preset.tp[0] > 1 else sorted({1, *tps})
    found = [
        (max(workers // (tp * cp), 1), 1, tp, cp)
        for tp in tp_options
        for cp in (cps if preset.cp else [1])
    ]
    if preset.takes_stages:  # and every stage sharded over its dp workers
        found += [layout for layout in staged if layout[0] > 1]
    return found


def _combinations(space, extra_keys: list[str]):
    """Every (strategy, workers, (dp, pp, tp, cp), sequence parallelism, micro-batches, batch
    size, compression, checkpointing, *extra) of the space; micro-batch counts only where
    there are stages, sequence parallelism only where there is tensor parallelism."""
    for strategy, workers in itertools.product(space.strategy, space.workers):
        for layout in _layouts(strategy, workers, space.pp, space.tp, space.cp):
            pipelined = PRESETS[strategy].needs_stages or layout[1] > 1
            yield from itertools.product(
                [strategy], [workers], [layout],
                space.sequence_parallel if layout[2] > 1 else [False],
                space.microbatches if pipelined else [1],
                space.batch_size,
                space.grad_compression,
                space.activation_checkpointing,
                *(space.extra[k] for k in extra_keys),
            )  # fmt: skip


def enumerate_candidates(spec: TuneSpec) -> tuple[list[Candidate], list[Pruned]]:
    """Every combination of the space, split into launchable candidates and pruned ones. Two
    names for one layout (FSDP with one shard per tensor-parallel group is 'tp') are one trial,
    under the layout's own name (`ParallelDims.preset_name`)."""
    space, budget = spec.search, spec.constraints
    valid: list[Candidate] = []
    pruned: list[Pruned] = []
    seen: set[str] = set()
    extra_keys = list(space.extra)
    for combination in _combinations(space, extra_keys):
        strategy, workers, (dp, pp, tp, cp), sp, micro, batch, compression, ac, *extra = combination
        candidate = Candidate(
            {
                "parallelism.strategy": strategy,
                "parallelism.workers": workers,
                "parallelism.dp": dp,
                "parallelism.pp": pp,
                "parallelism.tp": tp,
                "parallelism.cp": cp,
                "parallelism.sequence_parallel": sp,
                "parallelism.microbatches": micro,
                "training.batch_size": batch,
                "parallelism.grad_compression": compression,
                "training.activation_checkpointing": ac,
                "parallelism.resources_per_worker": {"CPU": budget.cpus_per_worker},
                **dict(zip(extra_keys, extra, strict=True)),
            }
        )
        if candidate.key in seen:
            continue
        seen.add(candidate.key)
        reason = prune_reason(spec, candidate)
        if reason:
            pruned.append(Pruned(candidate, reason))
        else:
            valid.append(candidate)
    return _one_per_layout(spec, valid, pruned)


def _one_per_layout(
    spec: TuneSpec, valid: list[Candidate], pruned: list[Pruned]
) -> tuple[list[Candidate], list[Pruned]]:
    """Keep one candidate of those that train the same thing: the one named as its layout is
    (else the first), the others pruned naming it."""
    groups: dict[tuple, list[Candidate]] = {}
    for candidate in valid:
        dims = trial_config(spec, candidate).parallelism.dims
        rest = {k: v for k, v in candidate.overrides.items() if k not in _DEGREE_KEYS}
        groups.setdefault((dims, repr(sorted(rest.items()))), []).append(candidate)
    kept: set[str] = set()
    for (dims, _), same in groups.items():
        named = [c for c in same if c.overrides["parallelism.strategy"] == dims.preset_name]
        keep = (named or same)[0]
        kept.add(keep.key)
        pruned += [Pruned(c, f"the same layout as {keep.key}") for c in same if c is not keep]
    return [c for c in valid if c.key in kept], pruned


_DEGREE_KEYS = {f"parallelism.{name}" for name in ("strategy", "dp", "pp", "tp", "cp")}


def prune_reason(spec: TuneSpec, candidate: Candidate) -> str | None:
    """Why `candidate` cannot run within the spec, or None."""
    o = candidate.overrides
    workers = o["parallelism.workers"]
    per_worker = spec.constraints.cpus_per_worker
    need = workers * per_worker + TRIAL_DRIVER_CPU
    if need > spec.constraints.cpus + 1e-9:
        return (
            f"needs {need:g} CPUs ({workers} workers x {per_worker:g} + {TRIAL_DRIVER_CPU:g} for "
            f"the trial driver), budget is {spec.constraints.cpus:g}"
        )
    if o["parallelism.grad_compression"] != "none" and workers == 1:
        return "one worker all-reduces no gradients: nothing to compress"
    try:
        trial_config(spec, candidate)
    except ConfigError as exc:
        return str(exc).split(": ", 1)[-1]
    return None


def trial_config(spec: TuneSpec, candidate: Candidate, *, for_trial: bool = True) -> RaylaneConfig:
    """The base config with the candidate applied; for a trial, shortened to measured epochs."""
    # The candidate names its layout by strategy and dp: a base config's own dp_shard would
    # turn its fsdp into HSDP.
    overrides = [*spec.base_overrides, *candidate.as_list(), "parallelism.dp_shard=null"]
    if for_trial:
        overrides += [
            f"training.epochs={spec.trial.epochs}",
            f"training.steps_per_epoch={spec.trial.steps_per_epoch}",
            "training.checkpoints_to_keep=1",
            # Trials report once per measured epoch (what Tune compares), never mid-epoch.
            "training.checkpoint_every_steps=null",
            "parallelism.min_workers=null",  # a trial measures its layout at its own size
            f"training.storage_path={spec.storage_path.resolve()}",
        ]
        # Trials run in a working directory of their own: relative paths are resolved here.
        return with_absolute_paths(load_config(spec.base, overrides))
    return load_config(spec.base, overrides)
