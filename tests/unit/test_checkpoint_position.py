"""Where training continues after a checkpoint: the next epoch after an epoch checkpoint, the
same epoch's next step (with the loss so far) after a step checkpoint; and which layouts may
checkpoint inside an epoch."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from raylane.config import ConfigError, load_config
from raylane.parallel.parallelize import apply_replicate
from raylane.train.checkpoint_files import META_FILE
from raylane.train.checkpointing import (
    Position,
    load_model_state,
    restore,
    resume_position,
    save_checkpoint,
    save_sharded_checkpoint,
)
from tests.readme_blocks import ROOT


def test_epoch_and_step_checkpoints_say_where_training_continues(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path / "epoch", model, optimizer, 4, {"val_loss": 0.5})
    assert resume_position(tmp_path / "epoch") == Position(5)
    step = {"epoch": 4, "step": 8, "loss_sum": 12.5, "rows": 1024}
    save_checkpoint(tmp_path / "step", model, optimizer, 4, step)
    assert resume_position(tmp_path / "step") == Position(4, 8, 12.5, 1024)
    other = torch.nn.Linear(3, 2)
    resumed = torch.optim.AdamW(other.parameters())
    assert restore(tmp_path / "step", other, resumed, other, 0) == Position(4, 8, 12.5, 1024)
    assert torch.equal(other.weight, model.weight)


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _same_state(model, optimizer, other, resumed) -> None:
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )
    for param, again in zip(model.parameters(), other.parameters(), strict=True):
        saved, loaded = optimizer.state[param], resumed.state[again]
        assert int(loaded["step"]) == int(saved["step"]) == 1
        assert torch.equal(loaded["exp_avg"], saved["exp_avg"])
        assert torch.equal(loaded["exp_avg_sq"], saved["exp_avg_sq"])


def test_a_checkpoint_is_one_distributed_checkpoint_and_the_assembled_model(tmp_path):
    model, optimizer = _trained()
    save_checkpoint(tmp_path, model, optimizer, 0, {"val_loss": 0.5})
    assert sorted(p.name for p in tmp_path.iterdir()) == [META_FILE, "model-part000.pt", "sharded"]
    assert (tmp_path / "sharded" / ".metadata").is_file()
    assert load_model_state(tmp_path).keys() == model.state_dict().keys()
    other = torch.nn.Linear(3, 2)
    resumed = torch.optim.AdamW(other.parameters(), lr=0.1)
    assert restore(tmp_path, other, resumed, other, 0) == Position(1)
    _same_state(model, optimizer, other, resumed)


def test_a_checkpoint_of_the_earlier_part_files_still_resumes(tmp_path):
    """Whole-model replicas and pipeline stages wrote `model-partNNN.pt` and
    `optimizer-partNNN.pt` before every checkpoint was DCP: such a run still resumes."""
    model, optimizer = _trained()
    torch.save(model.state_dict(), tmp_path / "model-part000.pt")
    torch.save(optimizer.state_dict(), tmp_path / "optimizer-part000.pt")
    (tmp_path / META_FILE).write_text('{"epoch": 2, "metrics": {}, "global_step": 30}')
    other = torch.nn.Linear(3, 2)
    resumed = torch.optim.AdamW(other.parameters(), lr=0.1)
    assert restore(tmp_path, other, resumed, other, 0) == Position(3, global_step=30)
    _same_state(model, optimizer, other, resumed)
    (tmp_path / "optimizer-part000.pt").unlink()
    with pytest.raises(FileNotFoundError, match="holds neither a distributed checkpoint"):
        restore(tmp_path, other, resumed, other, 0)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _earlier_parts_into_replicas(rank: int, world: int) -> dict:
    """A pipeline stage's replicas now hold replicated DTensors (FSDP2's `replicate`): a part
    file of the earlier format still resumes into them, on each replica, and the replicas
    then train as one (their gradients all-reduced inside backward)."""
    with tempfile.TemporaryDirectory() as scratch:
        return _parts_into_replicas(Path(scratch), rank, world)


def _parts_into_replicas(directory: Path, rank: int, world: int) -> dict:
    model, optimizer = _trained()
    torch.save(model.state_dict(), directory / "model-part000.pt")
    torch.save(optimizer.state_dict(), directory / "optimizer-part000.pt")
    (directory / META_FILE).write_text('{"epoch": 2, "metrics": {}, "global_step": 30}')
    torch.manual_seed(1 + rank)  # the replicas start apart: the checkpoint makes them agree
    replica = apply_replicate(torch.nn.Linear(3, 2), init_device_mesh("cpu", (world,)))
    resumed = torch.optim.AdamW(replica.parameters(), lr=0.1)
    position = restore(directory, replica, resumed, replica, 0)
    names = [name for name, _ in replica.named_parameters()]
    found = {
        "position": position,
        "dtensors": all(hasattr(p, "placements") for p in replica.parameters()),
        "saved": [p.detach().clone() for p in model.parameters()],
        "saved_avg": [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()],
        "loaded": [_local(p).detach().clone() for p in replica.parameters()],
        "loaded_avg": [_local(resumed.state[p]["exp_avg"]).clone() for p in replica.parameters()],
        "names": names,
    }
    torch.manual_seed(10 + rank)  # each replica its own rows
    replica(torch.randn(4, 3)).square().sum().backward()
    resumed.step()
    found["after"] = [_local(p).detach().clone() for p in replica.parameters()]
    # Plain SGD keeps no optimizer state: its part file resumes the weights alone.
    torch.save(torch.optim.SGD(model.parameters()).state_dict(), directory / "optimizer-part000.pt")
    plain_sgd = apply_replicate(torch.nn.Linear(3, 2), init_device_mesh("cpu", (world,)))
    restore(directory, plain_sgd, torch.optim.SGD(plain_sgd.parameters()), plain_sgd, 0)
    found["sgd_loaded"] = [_local(p).detach().clone() for p in plain_sgd.parameters()]
    return found


TWO_PROCESS_CHECKS = {"earlier_parts_into_replicas": _earlier_parts_into_replicas}


def test_an_earlier_part_file_resumes_into_replicated_dtensors(two_processes):
    ranks = two_processes(__name__, "earlier_parts_into_replicas")
    for found in ranks:
        assert found["position"] == Position(3, global_step=30)
        assert found["dtensors"] and found["names"] == ["weight", "bias"]
        for kind in ("", "_avg"):  # the weights, then Adam's first moments
            pairs = zip(found["saved" + kind], found["loaded" + kind], strict=True)
            for name, (saved, loaded) in zip(found["names"], pairs, strict=True):
                assert torch.equal(saved, loaded), (name, kind)
        assert all(map(torch.equal, found["saved"], found["sgd_loaded"]))
    # Different rows on each replica, one model after the step: the gradients were averaged.
    first, second = (found["after"] for found in ranks)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not torch.equal(first[0], ranks[0]["loaded"][0])  # and it stepped


@pytest.mark.parametrize("strategy", ["async", "ssp", "local_sgd"])
def test_step_checkpoints_need_a_synchronous_layout(strategy):
    with pytest.raises(
        ConfigError, match=f"needs replicas that agree after every step; '{strategy}'"
    ):
        load_config(
            ROOT / "configs" / "train" / "digits_ddp.yaml",
            [f"parallelism.strategy={strategy}", "training.checkpoint_every_steps=4"],
        )


def test_a_checkpoint_without_optimizer_state_and_of_another_model(tmp_path):
    """A parameter server's workers save no optimizer state (theirs never steps), and resume
    the model alone; a checkpoint of another model is refused in one line; a parameter that
    never had a gradient has no state to load and keeps its zero state."""
    model, optimizer = _trained()
    save_sharded_checkpoint(tmp_path / "ps", model, optimizer, 0, {}, writes_part=True,
                            with_optimizer=False)  # fmt: skip
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(tmp_path / "ps" / "sharded")).read_metadata()
    assert sorted(stored.state_dict_metadata) == ["model.bias", "model.weight"]
    other = torch.nn.Linear(3, 2)
    resumed = torch.optim.AdamW(other.parameters(), lr=0.1)
    assert restore(tmp_path / "ps", other, resumed, other, 0, with_optimizer=False) == Position(1)
    assert torch.equal(other.weight, model.weight) and not resumed.state

    wider = torch.nn.Linear(3, 2, bias=False)
    wider.scale = torch.nn.Parameter(torch.ones(2))  # a tensor the checkpoint never had
    with pytest.raises(ValueError, match="holds no 'scale' .1 of the model's 2 entries missing"):
        restore(tmp_path / "ps", wider, torch.optim.AdamW(wider.parameters()), wider, 0)

    partly = torch.nn.Linear(3, 2)
    partly.unused = torch.nn.Parameter(torch.ones(2))  # trainable, never in a loss
    stepped = torch.optim.AdamW(partly.parameters(), lr=0.1)
    partly(torch.randn(4, 3)).sum().backward()
    stepped.step()
    save_checkpoint(tmp_path / "partly", partly, stepped, 0, {})
    again = torch.nn.Linear(3, 2)
    again.unused = torch.nn.Parameter(torch.ones(2))
    fresh = torch.optim.AdamW(again.parameters(), lr=0.1)
    restore(tmp_path / "partly", again, fresh, again, 0)
    assert torch.equal(
        fresh.state[again.weight]["exp_avg"], stepped.state[partly.weight]["exp_avg"]
    )
    assert not fresh.state[again.unused]["exp_avg"].any()
