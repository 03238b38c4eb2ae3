"""Where training continues after a checkpoint: the next epoch after an epoch checkpoint, the
same epoch's next step (with the loss so far) after a step checkpoint; and which layouts may
checkpoint inside an epoch."""

from __future__ import annotations

import pytest
import torch

from raylane.config import ConfigError, load_config
from raylane.train.checkpointing import (
    Position,
    restore_checkpoint,
    resume_position,
    save_checkpoint,
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
    assert restore_checkpoint(tmp_path / "step", other, torch.optim.AdamW(other.parameters())) == (
        Position(4, 8, 12.5, 1024)
    )
    assert torch.equal(other.weight, model.weight)


@pytest.mark.parametrize("strategy", ["async", "ssp", "local_sgd"])
def test_step_checkpoints_need_a_synchronous_layout(strategy):
    with pytest.raises(
        ConfigError, match=f"needs replicas that agree after every step; '{strategy}'"
    ):
        load_config(
            ROOT / "configs" / "train" / "digits_ddp.yaml",
            [f"parallelism.strategy={strategy}", "training.checkpoint_every_steps=4"],
        )
