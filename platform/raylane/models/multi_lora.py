"""Several LoRA adapters of one base model, each sequence of a batch through its own adapter.

Serving adapters one merged model at a time would hold a copy of the base per adapter and
batch only requests for the same adapter together. As in S-LoRA and vLLM's multi-LoRA, the base
is held once and every adapted linear computes, per row of the batch,

    y = base(x) + scale[a] * (x @ A[a]^T) @ B[a]^T

where `a` is that row's adapter (row 0 of the stack is "no adapter": zeros). Different adapters
of a batch cost one gathered pair of small matmuls per adapted linear; a batch without adapters
costs nothing beyond the base. Adapters of different ranks share the stack padded to the largest
(zero rows and columns add nothing), so the result equals the adapter merged into the base
(`raylane.models.adapters.merge_adapters`) to float rounding.

`AdapterSet` owns the stack: it installs adapters (PEFT state dicts as a fine-tuning run
registers them), hands out their row, keeps a row while sequences use it, and reuses the least
recently used idle row when all `capacity` rows are taken. The stacks live on the base weights'
device and in their dtype (an adapter arrives as fp32 host tensors and is copied in), so a
model moved to a GPU or cast to bf16 before the set is made serves adapters there.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from raylane.models.kv_cache import ints_on, placement

LORA_A, LORA_B = ".lora_A.default.weight", ".lora_B.default.weight"


class AdapterCapacityError(RuntimeError):
    """Every adapter row holds an adapter that running sequences still use."""


@dataclass
class _Selection:
    """The adapter row of each row of the batch about to run (None: no adapter anywhere)."""

    rows: torch.Tensor | None = None


class MultiLoraLinear(nn.Module):
    """A linear layer plus a stack of low-rank updates, one chosen per batch row."""

    def __init__(self, base: nn.Linear, selection: _Selection, slots: int):
        super().__init__()
        self.base = base
        self.selection = selection
        # An int8 weight (torchao) reports the device and the dtype it computes in.
        device, dtype = base.weight.device, base.weight.dtype
        self.register_buffer(
            "lora_a", torch.zeros(slots, 0, base.in_features, device=device, dtype=dtype)
        )
        self.register_buffer(
            "lora_b", torch.zeros(slots, base.out_features, 0, device=device, dtype=dtype)
        )
        self.register_buffer("scale", torch.zeros(slots, device=device, dtype=dtype))

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def set_row(self, row: int, a: torch.Tensor | None, b: torch.Tensor | None, scale: float):
        """Put an update `B @ A` (`a` [r, in], `b` [out, r]) in `row`, or clear it (None)."""
        rank = 0 if a is None else a.shape[0]
        if rank > self.lora_a.shape[1]:  # pad the whole stack to the new largest rank
            extra = rank - self.lora_a.shape[1]
            self.lora_a = F.pad(self.lora_a, (0, 0, 0, extra))  # [slots, r, in]
            self.lora_b = F.pad(self.lora_b, (0, extra))  # [slots, out, r]
        self.lora_a[row].zero_()
        self.lora_b[row].zero_()
        self.scale[row] = 0.0
        if a is not None:
            self.lora_a[row, :rank] = a.to(device=self.lora_a.device, dtype=self.lora_a.dtype)
            self.lora_b[row, :, :rank] = b.to(device=self.lora_b.device, dtype=self.lora_b.dtype)
            self.scale[row] = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.selection.rows
        if rows is None or self.lora_a.shape[1] == 0:
            return y
        a, b = self.lora_a[rows], self.lora_b[rows]  # [n, r, in], [n, out, r]
        update = torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))
        return y + update * self.scale[rows].view(-1, 1, 1)


class AdapterSet:
    """Up to `capacity` LoRA adapters of `model` (a plain GPT) held together for serving.

    Adapters are known by a key (for instance `NAME/VERSION`). A sequence `acquire`s its
    adapter's row (the row stays installed until it is `release`d) and `select` sets the rows of
    the next forward; row 0 is the base alone. `acquire` and `release` may be called from any
    thread; `add` changes the layers' tensors, so it must not run during a forward.
    """

    def __init__(self, model: nn.Module, capacity: int):
        if capacity < 1:
            raise ValueError(f"an adapter set holds at least 1 adapter, not {capacity}")
        self.model = model
        self.capacity = capacity
        self.selection = _Selection()
        self.layers: dict[str, MultiLoraLinear] = {}
        self.rows: OrderedDict[str, int] = OrderedDict()  # key -> row, least recent first
        self.users: dict[int, int] = {}  # row -> sequences using it
        self.pinned: set[str] = set()
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def acquire(self, key: str) -> int:
        """The row of adapter `key` for a sequence that starts using it (marked most recently
        used; it stays installed until `release`). KeyError when it is not held."""
        with self._lock:
            self.rows.move_to_end(key)
            row = self.rows[key]
            self.users[row] = self.users.get(row, 0) + 1
            return row

    def release(self, row: int) -> None:
        """A sequence that used `row` ended."""
        if row:
            with self._lock:
                self.users[row] -= 1

    def add(self, key: str, state: dict[str, torch.Tensor], scale: float, pin: bool = False):
        """Install adapter `key` (a PEFT state dict under the model's parameter names, update
        scale `alpha / rank`) and return its row; an idle adapter makes room if all are held.

        Raises:
            ValueError: the state names a layer the model lacks or is not LoRA weights.
            AdapterCapacityError: every row is used by running sequences.
        """
        if key in self.rows:
            return self.rows[key]
        updates = _updates(state)
        linears = dict(self.model.named_modules())
        for path in updates:
            if path not in self.layers and not isinstance(linears.get(path), nn.Linear):
                raise ValueError(f"the adapter names {path!r}, not a linear layer of the model")
        with self._lock:
            row = self._free_row()
        for path in updates:
            if path not in self.layers:
                self._wrap(path)
        for path, layer in self.layers.items():
            a, b = updates.get(path, (None, None))
            layer.set_row(row, a, b, scale)
        self.rows[key] = row
        if pin:
            self.pinned.add(key)
        return row

    def select(self, rows: list[int]) -> None:
        """The adapter rows of the next forward's batch rows (on the model's device)."""
        self.selection.rows = ints_on(rows, placement(self.model)[0]) if any(rows) else None

    def _free_row(self) -> int:
        taken = set(self.rows.values())
        for row in range(1, self.capacity + 1):
            if row not in taken:
                return row
        for key, row in self.rows.items():  # least recently used first
            if key not in self.pinned and not self.users.get(row):
                del self.rows[key]
                return row
        raise AdapterCapacityError(
            f"all {self.capacity} adapter slots hold adapters in use; try again when a "
            "request ends (or raise serving.generation.max_adapters)"
        )

    def _wrap(self, path: str) -> None:
        parent_name, _, child = path.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        layer = MultiLoraLinear(getattr(parent, child), self.selection, self.capacity + 1)
        setattr(parent, child, layer)
        self.layers[path] = layer


def _updates(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{linear path: (A, B)}` from a PEFT adapter state dict."""
    updates = {}
    for name, tensor in state.items():
        if name.endswith(LORA_A):
            path = name[: -len(LORA_A)]
            b = state.get(path + LORA_B)
            if b is None:
                raise ValueError(f"the adapter has {name} without its {path + LORA_B}")
            updates[path] = (tensor.float(), b.float())
        elif not name.endswith(LORA_B):
            raise ValueError(f"the adapter holds {name!r}, which is not a LoRA weight")
    if not updates:
        raise ValueError("the adapter holds no LoRA weights")
    return updates
