"""The protocol every parallelism strategy implements.

A strategy is built inside each Ray Train worker (after the process group exists) and answers
the few questions on which strategies differ; the train loop asks it and never branches on a
strategy's name.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import Module
from torch.optim import Optimizer

from raylane.models.losses import cross_entropy, token_sums
from raylane.parallel.device import CPU, to_device, worker_device
from raylane.parallel.meters import ActivationMeter
from raylane.parallel.parallelize import parallelize
from raylane.parallel.precision import autocast

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ParallelStrategy(Protocol):
    name: str
    #: Ray Train shards the datasets across workers (else every worker sees all rows).
    splits_dataset: bool
    #: This worker trains on batch i when i % data_world == data_rank (after any sharding).
    data_rank: int
    data_world: int
    #: This worker's losses and outputs are the model's (the last pipeline stage; all DDP ranks).
    reports_loss: bool
    #: Evaluation may hand this worker a shorter last batch, even an empty slice (False: a
    #: pipeline's stages run the shapes they inferred, so its last partial batch is dropped).
    evaluates_ragged: bool
    #: Reporting workers that share each row (its sequence's cp workers), each counting 1/n.
    row_reporters: int
    #: The part number of this worker's assembled model in a checkpoint (its pipeline stage).
    checkpoint_part: int
    #: This worker's optimizer steps its parameters (False: a parameter server does; its
    #: checkpoints hold no optimizer state).
    steps_optimizer: bool
    #: Replicas hold the same parameter and optimizer state after an epoch (False: a
    #: checkpoint keeps rank 0's copy whole).
    replicas_agree: bool
    #: Seconds of the last `train_step` by part: 'compute', 'comm' (exposed communication),
    #: 'bubble' (pipeline stages waiting for each other); see raylane.tracking.step_times.
    last_step_parts: dict[str, float]
    #: Every worker writes its shards of each checkpoint (torch distributed checkpoint), and
    #: those with `writes_part` their assembled part as well (`raylane.train.checkpointing`).
    writes_part: bool
    #: The strategy's own activation meter (pipeline stages measure inside their schedule);
    #: None: the loop meters each step.
    activations: ActivationMeter | None
    #: JSON tables rank 0 logs with the run each epoch (name -> dict).
    run_tables: dict[str, dict]
    #: Where this worker's model computes (`raylane.parallel.device.worker_device`): batches
    #: are copied there, and its outputs and losses stay there.
    device: torch.device

    def steps_done(self) -> None:
        """This worker's steps of an epoch are over, before the epoch's collectives (a worker
        others may be waiting for says it stopped)."""
        ...

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Apply the strategy to a plain model on this worker; return what this worker trains."""
        ...

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The plain module (or stage) behind a wrapped one, for checkpoints."""
        ...

    def train_step(
        self, model: Module, optimizer: Optimizer, loss_fn: LossFn, inputs: Tensor, targets: Tensor
    ) -> Tensor | None:
        """Forward, backward and optimizer step on one batch; the loss where `reports_loss`."""
        ...

    def forward(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor | None:
        """Evaluation forward of one batch; the outputs where `reports_loss`, else None."""
        ...

    def validation_sums(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """`(loss_sum, correct, counted)` of one validation batch (`token_sums`), where
        `reports_loss`, else None."""
        ...

    def epoch_stats(self) -> dict[str, float]:
        """Strategy-specific measurements of the last epoch (collective: every rank calls)."""
        ...

    def local_batch(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """What this worker computes on of its rows (its chunks of each sequence under
        context parallelism, else all of them)."""
        ...


class StrategyDefaults:
    """The one training step every strategy but the pipeline's runs, and what a strategy that
    has nothing special there does for the protocol's other parts: no assembled model to
    write, the loop's own activation meter, no run tables, nothing to do when its steps end, the
    plain model, evaluation on this worker's device (its outputs stay there: the loop sums on
    the device and syncs once an epoch), no epoch stats.

    The step is zero_grad -> forward -> backward -> `sync_gradients` -> optimizer step (unless
    the strategy's parameters are updated elsewhere: `steps_optimizer`) -> `after_step`; the
    forward runs in `precision` (bf16: under autocast), the loss on fp32 outputs.
    What the two hooks take, and what `backward_comm_s` says backward waited for collectives
    after its last gradient was ready, is the step's exposed communication; the rest is
    compute. Pipelines override `train_step`: their schedule drives forward and backward.
    """

    writes_part = False
    evaluates_ragged = True
    activations: ActivationMeter | None = None
    run_tables: dict[str, dict] = {}  # noqa: RUF012 - a strategy that has tables sets its own
    device: torch.device = CPU
    #: False where the parameters come back from elsewhere (a parameter server).
    steps_optimizer = True
    #: Whether the replicas of a parameter hold the same state after an epoch, optimizer's
    #: included (False for local SGD: each keeps its own moments; a checkpoint keeps rank 0's).
    replicas_agree = True
    #: Optimizer steps taken since the strategy's epoch stats last reset.
    steps = 0
    #: `training.precision`: 'bf16' runs forwards under autocast (raylane.parallel.precision).
    precision = "fp32"
    #: `training.loss_chunk_mb` in bytes where this layout runs the model's head and loss
    #: together (`model(inputs, targets=...)`: a model that `takes_targets`); 0: never.
    loss_chunk_bytes = 0.0
    row_reporters = 1

    def sync_gradients(self, model: nn.Module) -> None:
        """After backward, before the optimizer step: make the gradients the replicas'."""
        return None

    def after_step(self, model: nn.Module) -> None:
        """After the optimizer step (local SGD averages the parameters here)."""
        return None

    def loss_scope(self) -> contextlib.AbstractContextManager:
        """Where the loss and its backward run (a vocabulary-split head's loss needs torch's
        `loss_parallel`: `raylane.parallel.mesh_parallel`)."""
        return contextlib.nullcontext()

    def ring_wait_s(self) -> float:
        """Seconds the last step's forward and backward waited for context parallelism's
        ring transfers (counted apart from compute)."""
        return 0.0

    def backward_comm_s(self, backward_started: float, backward_done: float) -> float:
        """Seconds of backward spent only waiting for collectives (DDP's last buckets)."""
        return 0.0

    def train_step(
        self, model: Module, optimizer: Optimizer, loss_fn: LossFn, inputs: Tensor, targets: Tensor
    ) -> Tensor:
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        targets = to_device(targets, self.device)
        fused = self._fuses_loss(model, loss_fn)
        with autocast(self.precision, self.device):
            inputs = to_device(inputs, self.device)
            if fused:  # the head and the loss in chunks: never the whole logits
                loss = model(inputs, targets=targets, chunk_bytes=self.loss_chunk_bytes)
            else:
                outputs = model(inputs)
        with self.loss_scope():
            if not fused:
                loss = loss_fn(outputs.float(), targets)
            backward_started = time.perf_counter()
            loss.backward()
            backward_done = time.perf_counter()
        self.sync_gradients(model)
        synced = time.perf_counter()
        if self.steps_optimizer:
            optimizer.step()
        stepped = time.perf_counter()
        self.after_step(model)
        done = time.perf_counter()
        comm = (
            self.backward_comm_s(backward_started, backward_done)
            + (synced - backward_done)
            + (done - stepped)
        )
        ring = self.ring_wait_s()
        self.last_step_parts = {"compute": done - started - comm - ring, "comm": comm, "ring": ring}
        self.steps += 1
        return plain_value(loss.detach())

    def steps_done(self) -> None:
        return None

    def _fuses_loss(self, model: nn.Module, loss_fn: LossFn) -> bool:
        """Whether this step runs the head and the loss inside the model's forward: where the
        layout allows it (`loss_chunk_bytes`), the loss is raylane's own and the model takes
        targets."""
        plain = self.unwrap_model(model)
        return (
            bool(self.loss_chunk_bytes)
            and loss_fn is cross_entropy
            and (
                getattr(plain, "takes_targets", False) and getattr(plain, "head", None) is not None
            )
        )

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def forward(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor | None:
        with autocast(self.precision, self.device):
            return model(to_device(inputs, self.device)).float()

    #: Whether validation may run the head and the loss's sums in chunks inside the model's
    #: forward (as the step does where it `_fuses_loss`): a strategy with its own evaluation
    #: forward (the mesh's, the pipeline's) computes the logits there.
    chunked_validation = True

    def validation_sums(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        if self.chunked_validation and self._fuses_loss(model, cross_entropy):
            with autocast(self.precision, self.device):
                return model(
                    to_device(inputs, self.device), targets=to_device(targets, self.device),
                    chunk_bytes=self.loss_chunk_bytes, sums=True,
                )  # fmt: skip
        outputs = self.forward(model, inputs, targets)
        if outputs is None or not targets.numel():
            return None
        return token_sums(outputs, targets)

    def epoch_stats(self) -> dict[str, float]:
        return {}

    def local_batch(self, inputs: torch.Tensor, targets: torch.Tensor):
        """The part of a batch's rows this worker computes on: all of it (context parallelism
        keeps its chunks of each sequence)."""
        return inputs, targets


class WholeModelReplica(StrategyDefaults):
    """Every worker holds the whole model and trains on its own shard of the data (DDP, local
    SGD, the parameter server); rank 0 writes the assembled model of each checkpoint."""

    splits_dataset = True
    data_rank, data_world = 0, 1
    reports_loss = True
    checkpoint_part = 0

    def __init__(self, cfg, rank: int):
        self.name = cfg.parallelism.strategy
        self.rank = rank
        self.device = worker_device(cfg.parallelism.use_gpu)
        self.activation_checkpointing = cfg.training.activation_checkpointing
        self.compile_blocks = cfg.training.compile
        self.precision = cfg.training.precision
        self.loss_chunk_bytes = cfg.training.loss_chunk_mb * 2**20
        self.writes_part = rank == 0
        self.last_step_parts: dict[str, float] = {}
        self.sent_bytes = self.dense_bytes = self.steps = 0
        if cfg.parallelism.elastic:
            # Every worker reads the same global batches and takes its slice of each, so which
            # samples a step trains on does not depend on how many workers there are.
            self.splits_dataset = False
            self.data_rank, self.data_world = rank, world_size()

    def place(self, model: nn.Module, all_reduce: bool = False) -> nn.Module:
        """The plain model on this worker's device, with the layout's steps that apply to a
        whole-model replica (activation checkpointing, compile) and, with `all_reduce`, DDP as
        its data-parallel sync; without it, each strategy synchronises its own way."""
        return parallelize(
            model.to(self.device),
            None,
            activation_checkpointing=self.activation_checkpointing,
            compile_blocks=self.compile_blocks,
            ddp_device=self.device if all_reduce else None,
        )


def plain_value(loss: Tensor) -> Tensor:
    """`loss` as a plain tensor: under torch's `loss_parallel` (a vocabulary-split head) it is
    a replicated DTensor, and the loop's epoch sums meet a collective that takes no DTensor
    (`Operator c10d.allreduce_.default does not have a sharding strategy registered`). A
    replicated DTensor's full tensor is its local one: nothing is sent."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(loss, dtensor.DTensor):
        return loss.full_tensor()
    return loss


def world_size() -> int:
    """Workers in the process group (1 when there is none)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
