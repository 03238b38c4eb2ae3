"""What every model replica is built from, alike for the OIP and the generation server: the
registry version it serves and the name it answers to, its request guard and its placement.
"""

from __future__ import annotations

from dataclasses import dataclass

from raylane.serving.guard import GuardSettings


@dataclass(frozen=True)
class ReplicaSetup:
    """The first argument of each deployment. `api_key_digest`: the SHA-256 of the endpoint's
    key (never the key, see `raylane.serving.guard`); `replica_gpus`: the GPUs Ray gives the
    replica, which computes on one when above 0."""

    tracking_uri: str
    registered_model: str
    version: int
    model_name: str
    api_key_digest: str | None = None
    max_body_bytes: int = GuardSettings.max_body_bytes
    torch_threads: int = 1
    replica_gpus: float = 0.0

    def start(self, guard: GuardSettings):
        """In the replica: torch's threads and the request `guard` set; the device it
        computes on."""
        import torch  # lazy: the deploying process builds the app without torch

        from raylane.serving.generation.placement import serving_device  # lazy: torch, as above

        torch.set_num_threads(self.torch_threads)
        guard.key_digest = self.api_key_digest
        guard.max_body_bytes = self.max_body_bytes
        return serving_device(self.replica_gpus)
