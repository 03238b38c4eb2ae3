"""Layouts that split the model on one mesh without pipeline stages: tensor parallel (strategy
'tp'), FSDP2 (strategy 'fsdp'; HSDP with `dp_shard` below the data-parallel workers), and both
(FSDP over tensor-parallel blocks, 2D: dp x tp).

`parallelize` applies the whole layout to the plain model (the model's tensor-parallel plan,
activation checkpointing, and as its last step the data-parallel sync: FSDP over the `dp_shard`
workers, reduce-scattering the gradients inside backward and for HSDP all-reducing the shards
over the replicas; or, for replicas of an unsharded tensor- or context-parallel model, FSDP2's
`replicate`, all-reducing them inside backward). What is left to this strategy is the one sync
an apply step does not do: a compressed average of the replicas' gradient shards before each
optimizer step (`parallelism.grad_compression` 'fp16' or 'topk', the same compression DDP's
hooks apply). The tp workers of one replica read the same batches and compute the same loss.
"""

from __future__ import annotations

import torch
from torch import nn

from raylane.config import RaylaneConfig
from raylane.parallel.base import StrategyDefaults
from raylane.parallel.collectives import average_gradients
from raylane.parallel.device import to_device, worker_device
from raylane.parallel.grad_compression import GroupAverager, take_comm_stats
from raylane.parallel.mesh import build_device_mesh
from raylane.parallel.meters import local_bytes
from raylane.parallel.parallelize import parallelize, sharded_loss
from raylane.parallel.precision import autocast
from raylane.parallel.ring_attention import RingTraffic, shard_sequence


class MeshParallel(StrategyDefaults):
    """`tp` workers per model, `dp` replicas of it or `dp` shards of it (workers = dp * tp)."""

    splits_dataset = False
    checkpoint_part = 0

    def __init__(self, cfg: RaylaneConfig, rank: int):
        par = cfg.parallelism
        self.name = par.strategy
        self.device = worker_device(par.use_gpu)
        self.activation_checkpointing = cfg.training.activation_checkpointing
        self.compile_blocks = cfg.training.compile
        self.precision = cfg.training.precision
        self.mesh = build_device_mesh(par.dims, self.device.type)
        self.dp, self.tp = self.mesh.dp, self.mesh.tp
        self.dp_rank, self.tp_rank = self.mesh.dp_rank, self.mesh.tp_rank
        self.data_rank, self.data_world = self.dp_rank, self.dp
        # The tp workers of a replica compute the same loss; one of them reports it.
        self.reports_loss = self.tp_rank == 0
        self.writes_part = rank == 0  # the assembled model
        self.last_step_parts: dict[str, float] = {}
        self.averager = None
        self.replicated_bytes = 0
        # Replicas, and the workers holding a sequence's other chunks, average their gradients.
        self.cp, self.cp_rank = self.mesh.dims.cp, self.mesh.cp_rank
        self.row_reporters = self.cp  # every cp worker reports its chunks' loss
        self.ring = self._ring_meter()
        self.ring_waited_s = 0.0
        # Sequence parallelism runs the model's end on shards too: the head's logits are split
        # over the vocabulary and the loss is torch's `loss_parallel`.
        self.vocabulary_loss = self.mesh.dims.sequence_parallel
        # The head and loss in chunks inside forward, where the head is whole (no tp).
        self.loss_chunk_bytes = cfg.training.loss_chunk_mb * 2**20 if self.tp == 1 else 0.0
        # Replicas average inside backward (FSDP2, `parallelize`'s last step) unless their
        # average is compressed: then here, before each optimizer step.
        self.replicas = self.mesh.replicas
        hand_averaged = not self.mesh.dims.fsdp_enabled and not self.mesh.replicate_in_backward
        if self.replicas > 1 and hand_averaged:
            self.averager = GroupAverager(
                par.grad_compression, self.mesh.replica_group, par.topk_ratio
            )

    def wrap_model(self, model: nn.Module) -> nn.Module:
        wrapped = parallelize(
            model.to(self.device),
            self.mesh,
            activation_checkpointing=self.activation_checkpointing,
            precision=self.precision,
            ring_traffic=self.ring,
            vocabulary_loss=self.vocabulary_loss,
            compile_blocks=self.compile_blocks,
        )
        if self.mesh.replicate_in_backward:  # what the replicas' all-reduce carries each step
            trained = [p for p in wrapped.parameters() if p.requires_grad]
            self.replicated_bytes = sum(local_bytes(p) for p in trained)
        return wrapped

    def loss_scope(self):
        if not self.vocabulary_loss:
            return super().loss_scope()
        return sharded_loss()

    def _ring_meter(self):
        if self.cp == 1:
            return None
        return RingTraffic()

    def ring_wait_s(self) -> float:
        if self.ring is None:
            return 0.0
        waited, self.ring_waited_s = self.ring.wait_s - self.ring_waited_s, self.ring.wait_s
        return waited

    def sync_gradients(self, model: nn.Module) -> None:
        # The tensor-parallel all-reduces, FSDP's all-gathers and reduce-scatters and the
        # replicas' all-reduce run inside forward and backward: counted as compute. A
        # compressed average of the replicas runs here.
        if self.averager is not None:
            average_gradients(model, self.mesh.replica_group, self.replicas, self.averager)

    def local_batch(self, inputs: torch.Tensor, targets: torch.Tensor):
        """With context parallelism, this worker's chunks of each sequence and its targets."""
        if self.cp == 1:
            return inputs, targets
        return tuple(shard_sequence(t, 1, self.cp_rank, self.cp) for t in (inputs, targets))

    chunked_validation = False  # its own evaluation forward, below

    def forward(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor | None:
        with autocast(self.precision, self.device):
            outputs = model(to_device(inputs, self.device))  # every tp worker takes part
        if self.vocabulary_loss:  # each worker's logits are its share of the vocabulary
            outputs = outputs.full_tensor()
        outputs = outputs.float()
        if self.ring is not None:  # an evaluation's ring waits belong to no training step
            self.ring_waited_s = self.ring.wait_s
        return outputs if self.reports_loss else None

    def epoch_stats(self) -> dict[str, float]:
        """Bytes this worker handed to the replicas' gradient averages per step (as DDP reports
        them): counted by a compressed average; for FSDP2's all-reduce, every gradient this
        worker holds, in fp32 (its reduction has no hook to count at)."""
        if self.averager is not None:
            stats, self.steps = take_comm_stats(self.averager.meter, self.steps), 0
            return stats
        if self.replicated_bytes and self.steps:
            self.steps = 0
            return {"comm_bytes_per_step": float(self.replicated_bytes), "comm_bytes_ratio": 1.0}
        return {}
