"""DDP gradient compression through torch's communication hooks."""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel


def register_compression(model, method: str) -> None:
    """Register the hook for `method` ('fp16', 'bf16', 'powersgd') on a DDP model.

    A model that is not wrapped in DDP (a single worker) all-reduces nothing; it is left as is.
    """
    if method == "none" or not isinstance(model, DistributedDataParallel):
        return
    if method == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif method == "powersgd":
        # Short runs: start compressing after 2 plain all-reduces (the default waits 1,000).
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise ValueError(f"unknown gradient compression {method!r}")
