"""`model.kind: custom`: a user's factory imported from the working directory and checked before
Ray starts (each refusal one line naming the field), called with `model.args`, its own loss when
it returns one; its blocks chosen for FSDP, activation checkpointing and compile; and the
shipped example trained by DDP, FSDP2 and its tensor-parallel plan over a 2-process gloo group,
equal to one process."""

from __future__ import annotations

import hashlib
import sys
import uuid
from pathlib import Path

import pytest
import ray
import torch
from torch import nn
from torch.nn import functional as F

import raylane.parallel.parallelize as parallelize
from raylane import runtime
from raylane.config import ConfigError
from raylane.config.loader import validate_config
from raylane.models import build_model
from raylane.models.classifier import build_model_and_loss
from raylane.models.custom import BLOCK_CLASS_ATTRIBUTE, check_custom_model
from raylane.models.losses import cross_entropy
from raylane.parallel.parallelize import model_blocks

from .test_config import ROOT

EXAMPLE = "examples.custom_model.my_model:residual_mlp"
USER_MODULE = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + self.linear(x)

class Net(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 10)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)

def build(width=8, depth=2):
    return Net(width, depth)

def with_loss(width=8):
    return Net(width, 2), lambda outputs, labels: (outputs.mean() - labels.float().mean()) ** 2

def flat():
    return nn.Sequential(nn.Linear(64, 10))

def broken(width=8):
    raise RuntimeError("no weights at /nowhere")

def not_a_module():
    return {"net": 1}

def triple():
    return Net(8, 2), Net(8, 2), None

def pair_without_loss():
    return Net(8, 2), 3

class Planned(Net):
    tp_plan = "no_such_plan_module"

def planned():
    return Planned(8, 2)

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """A factory module in a fresh working directory (a unique name: modules stay imported)."""
    name = f"user_model_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return name


def _config(model: dict, **sections):
    return validate_config({"experiment": "t", "model": {"kind": "custom", **model}, **sections})


def _refusal(model: dict, **sections) -> str:
    with pytest.raises(ConfigError) as caught:
        cfg = _config(model, **sections)
        check_custom_model(cfg)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_the_factory_is_imported_from_the_working_directory_and_called_with_its_args(user_module):
    cfg = _config({"factory": f"{user_module}:build", "args": {"width": 12, "depth": 3}})
    model = build_model(cfg.model)
    assert type(model).__name__ == "Net" and model.inp.out_features == 12
    assert len(model.layers) == 3
    model, loss_fn = build_model_and_loss(cfg.model)
    assert loss_fn is cross_entropy  # no loss of its own: the task's


def test_a_pair_trains_with_its_own_loss(user_module):
    cfg = _config({"factory": f"{user_module}:with_loss", "args": {"width": 4}})
    model, loss_fn = build_model_and_loss(cfg.model)
    outputs, labels = torch.ones(3, 10), torch.tensor([1, 1, 4])
    assert loss_fn is not cross_entropy and loss_fn(outputs, labels).item() == pytest.approx(1.0)
    assert isinstance(model, nn.Module) and model.inp.out_features == 4


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"factory": "nocolon"}, "model.factory 'nocolon' is not 'package.module:function'"),
        ({"factory": "a b:c"}, "model.factory 'a b:c' is not 'package.module:function'"),
        ({}, "model.kind 'custom' needs model.factory: 'package.module:function'"),
        ({"factory": "{m}:biuld"}, "has no attribute 'biuld' (did you mean 'build'?)"),
        ({"factory": "{m}:NOT_CALLABLE"}, "model.factory: {m}:NOT_CALLABLE is a int, not a"),
        ({"factory": "{m}_gone:build"}, "model.factory: module '{m}_gone' is not importable from "
         "the working directory ({cwd}) nor an installed package"),
    ],
)  # fmt: skip
def test_a_factory_that_cannot_be_imported_is_refused_when_the_config_loads(
    user_module, model, expected
):
    model = {k: v.format(m=user_module) for k, v in model.items()}
    with pytest.raises(ConfigError) as caught:
        _config(model)
    expected = expected.format(m=user_module, cwd=Path.cwd())
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_a_module_that_fails_to_import_is_named_with_its_error(tmp_path, monkeypatch):
    name = f"user_model_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("import no_such_dependency\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(ConfigError, match=f"model.factory: importing '{name}' raised "
                       "ModuleNotFoundError: No module named 'no_such_dependency'"):  # fmt: skip
        _config({"factory": f"{name}:build"})


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"factory": "{m}:broken", "args": {"width": 3}},
         "model.factory: {m}:broken(width=3) raised RuntimeError: no weights at /nowhere"),
        ({"factory": "{m}:build", "args": {"widht": 3}},
         "model.factory: {m}:build(widht=3) raised TypeError: build() got an unexpected keyword"),
        ({"factory": "{m}:not_a_module"},
         "model.factory: {m}:not_a_module returned dict, not a torch nn.Module or a pair"),
        ({"factory": "{m}:triple"},
         "model.factory: {m}:triple returned a tuple of Net, Net, NoneType, not a torch nn.Module"),
        ({"factory": "{m}:pair_without_loss"},
         "returned (Net, int): the second item must be loss_fn(outputs, labels)"),
        ({"factory": "{m}:build", "block_class": "Blok"},
         "model.block_class 'Blok': Net holds no module of that class (it holds Block, Linear, "
         "ModuleList)"),
    ],
)  # fmt: skip
def test_a_factory_that_builds_no_model_is_refused_before_ray_starts(user_module, model, expected):
    model = {k: v.format(m=user_module) if isinstance(v, str) else v for k, v in model.items()}
    assert expected.format(m=user_module) in _refusal(model)


def test_the_preflight_runs_the_check(user_module, tmp_path):
    # here, not at the top: the data checks' pyarrow would load in every spawned worker below
    from raylane.train.preflight import check_run_inputs

    cfg = _config(
        {"factory": f"{user_module}:broken"},
        tracking={"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"},
    )
    with pytest.raises(ConfigError, match="raised RuntimeError: no weights at /nowhere"):
        check_run_inputs(cfg)


def test_layouts_without_a_plan_for_the_model_are_refused(user_module):
    factory = {"factory": f"{user_module}:build"}
    tp = {"strategy": "tp", "workers": 2, "tp": 2}
    assert _refusal(factory, parallelism=tp) == (
        "parallelism.tp 2 splits the model by its plan, and Net has no tp_plan attribute (the "
        "name of a module with block_plan(sequence_parallel), as raylane.models.gpt_plan); use a "
        "data-parallel strategy (ddp, fsdp) or add one"
    )
    pipeline = {"strategy": "pipeline", "workers": 2, "pp": 2, "microbatches": 2}
    assert "a custom model (model.kind 'custom') has no stage plan: set pp 1" in _refusal(
        factory, parallelism=pipeline
    )
    assert "has no context-parallel plan: set cp 1" in _refusal(
        factory, parallelism={"strategy": "ddp", "workers": 2, "cp": 2}
    )
    flat = {"factory": f"{user_module}:flat"}
    assert _refusal(flat, training={"activation_checkpointing": True}) == (
        "training.activation_checkpointing recomputes the model's blocks: Sequential has no "
        "repeated children; set model.block_class"
    )
    assert _refusal({"factory": f"{user_module}:planned"}, parallelism=tp) == (
        "parallelism.tp 2: Planned.tp_plan 'no_such_plan_module' does not import "
        "(ModuleNotFoundError: No module named 'no_such_plan_module')"
    )
    check_custom_model(_config({"factory": EXAMPLE}, parallelism=tp))  # the example has a plan


def test_the_factory_fields_belong_to_custom_models():
    with pytest.raises(ConfigError, match="model.factory is read by kind 'custom', not 'mlp'"):
        validate_config({"experiment": "t", "model": {"factory": EXAMPLE}})


def test_blocks_are_the_repeated_children_or_the_named_class(user_module):
    model = build_model(_config({"factory": f"{user_module}:build", "args": {"depth": 3}}).model)
    assert getattr(model, BLOCK_CLASS_ATTRIBUTE) == "Block"  # found: the Linears are torch's
    assert model_blocks(model) == list(model.layers)
    named = build_model(_config({"factory": f"{user_module}:build", "block_class": "Linear"}).model)
    # Outermost modules of the class: the blocks' own Linears are inside no other Linear.
    assert len(model_blocks(named)) == 2 + 2
    assert model_blocks(build_model(_config({"factory": f"{user_module}:flat"}).model)) == []
    mlp = build_model(validate_config({"experiment": "t"}).model)
    assert model_blocks(mlp) == []  # the built-in classifiers stay one unit
    checkpointed = parallelize.parallelize(model, None, activation_checkpointing=True)
    assert all(
        block.forward.func is torch.utils.checkpoint.checkpoint for block in checkpointed.layers
    )


def test_the_attribute_is_one_name_on_both_sides():
    assert BLOCK_CLASS_ATTRIBUTE == parallelize.BLOCK_CLASS_ATTRIBUTE


def test_the_run_records_the_factory_and_its_source_digest():
    cfg = _config({"factory": EXAMPLE})
    source = ROOT / "examples" / "custom_model" / "my_model.py"
    assert cfg.model.factory_tags() == {
        "raylane.model_factory": EXAMPLE,
        "raylane.model_factory_file": str(source),
        "raylane.model_factory_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
    }
    assert validate_config({"experiment": "t"}).model.factory_tags() == {}


# The shipped example, trained 3 SGD steps by 2 gloo workers and by one process on the same
# global batches, with its own loss (label smoothing). Measured on CPU (fp32): parameters differ
# by at most 6e-8 (DDP), 6e-8 (FSDP2), 1.2e-7 (tp) while the steps move them by up to 0.2;
# 1e-6 is asserted.
ARGS = {"width": 16, "depth": 2, "label_smoothing": 0.1}
ROWS, STEPS, LR, ATOL = 8, 3, 0.2, 1e-6


def _layout(strategy: str, **parallelism):
    return _config(
        {"factory": EXAMPLE, "args": ARGS},
        parallelism={"strategy": strategy, "workers": 2, **parallelism},
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.rand(2 * ROWS, 64, generator=generator) * 16,
         torch.randint(0, 10, (2 * ROWS,), generator=generator))
        for _ in range(STEPS)
    ]  # fmt: skip


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in model.state_dict().items()
    }


def _train(strategy, model, loss_fn, rows: slice) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for inputs, targets in _batches():
        strategy.train_step(model, optimizer, loss_fn, inputs[rows], targets[rows])
    return _whole(strategy.unwrap_model(model))


def _layouts(rank: int, world: int) -> dict:
    """One process's training, then each layout's from the same weights: their errors."""
    from torch.nn.parallel import DistributedDataParallel

    from raylane.parallel.base import StrategyDefaults
    from raylane.parallel.ddp import DataParallel
    from raylane.parallel.grad_compression import register_compression
    from raylane.parallel.mesh_parallel import MeshParallel

    cfg = _layout("ddp")
    torch.manual_seed(0)
    initial, loss_fn = build_model_and_loss(cfg.model)
    alone = _train(StrategyDefaults(), _copy(initial), loss_fn, slice(None))
    half = slice(rank * ROWS, (rank + 1) * ROWS)
    ddp = DataParallel(cfg, rank)
    replica = DistributedDataParallel(ddp.place(_copy(initial)))
    ddp.meter = register_compression(replica, "none")
    results = {
        "moved": _error(alone, initial.state_dict()),
        "ddp": _train(ddp, replica, loss_fn, half),
    }
    fsdp = MeshParallel(_layout("fsdp"), rank)
    sharded = fsdp.wrap_model(_copy(initial))
    results["fsdp units"] = sum(type(m).__name__.startswith("FSDP") for m in sharded.modules())
    results["fsdp"] = _train(fsdp, sharded, loss_fn, half)
    tp = MeshParallel(_layout("tp", tp=2), rank)
    split = tp.wrap_model(_copy(initial))
    results["tp up rows"] = split.blocks[0].up.weight.to_local().shape[0]
    results["tp"] = _train(tp, split, loss_fn, slice(None))
    return {k: _error(v, alone) if isinstance(v, dict) else v for k, v in results.items()}


TWO_PROCESS_CHECKS = {"layouts": _layouts}


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def _error(found: dict, expected: dict) -> float:
    assert found.keys() == expected.keys()
    return max((found[k] - expected[k]).abs().max().item() for k in expected)


@pytest.fixture(scope="module")
def layout_errors(two_processes) -> list[dict]:
    return two_processes(__name__, "layouts")


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp"])
def test_the_example_trains_equal_to_one_process(layout, layout_errors):
    for rank, errors in enumerate(layout_errors):
        error, moved = errors[layout], errors["moved"]
        print(f"{layout}, rank {rank}: max abs error {error:.2e}, parameters moved {moved:.2e}")
        assert errors[layout] <= ATOL < errors["moved"] / 1000, errors
        assert errors["fsdp units"] == ARGS["depth"] + 1  # each ResidualBlock, then the root
        assert errors["tp up rows"] == 4 * ARGS["width"] // 2  # each worker: half of `up`


def test_the_example_loss_is_label_smoothed():
    _, loss_fn = build_model_and_loss(_layout("ddp").model)
    outputs, labels = torch.randn(4, 10), torch.tensor([0, 1, 2, 3])
    expected = F.cross_entropy(outputs, labels, label_smoothing=0.1)
    assert torch.equal(loss_fn(outputs, labels), expected)


def test_a_working_directory_factory_is_shipped_to_a_running_clusters_nodes(
    user_module, tmp_path, monkeypatch
):
    """What `connect_ray` sends as `py_modules` to a cluster's nodes: the factory's module
    file (or top-level package directory) from the working directory; nothing for an
    installed package, a module outside the working directory or another kind of model."""
    cfg = _config({"factory": f"{user_module}:build", "args": {"width": 4}})
    assert cfg.model.factory_source() == (tmp_path / f"{user_module}.py").resolve()
    top = f"pkg_{uuid.uuid4().hex[:8]}"  # a namespace package (no __init__.py), two deep
    (tmp_path / top / "models").mkdir(parents=True)
    (tmp_path / top / "models" / "net.py").write_text(USER_MODULE)
    cfg = _config({"factory": f"{top}.models.net:build", "args": {"width": 4}})
    assert cfg.model.factory_source() == (tmp_path / top).resolve()
    installed = _config({"factory": "torch.nn:Linear", "args": {"in_features": 2,
                                                                 "out_features": 2}})  # fmt: skip
    assert installed.model.factory_source() is None
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the module is still imported, from outside this directory
    assert cfg.model.factory_source() is None
    assert validate_config({"experiment": "t"}).model.factory_source() is None


@pytest.mark.parametrize(
    ("address", "in_job", "shipped"),
    [("127.0.0.1:6379", False, True), ("127.0.0.1:6379", True, False), (None, False, False)],
)
def test_connect_ray_ships_only_to_a_running_cluster_outside_a_submitted_job(
    monkeypatch, tmp_path, address, in_job, shipped
):
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs) or _Context())
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if in_job:
        monkeypatch.setenv(runtime.JOB_CONFIG_ENV, "{}")
    else:
        monkeypatch.delenv(runtime.JOB_CONFIG_ENV, raising=False)
    runtime.connect_ray(address, ship=tmp_path)
    expected = {"py_modules": [str(tmp_path)]} if shipped else None
    assert calls[0]["runtime_env"] == expected


class _Context:
    address_info = {"session_dir": "/tmp/ray/session_latest"}
