"""Load a model version from the MLflow Model Registry and run batched forwards on it, on the
host or on a GPU (`serving.replica_gpus`).

Registered models are torch.export programs (MLflow's pt2 format). MLflow loads them on the
device they were exported on (the host: training exports there) and refuses to move them, and
the graph keeps the device of the tensors it makes (a GPT's position `arange`) as a constant, so
`move_exported` moves both the weights and those constants. Inputs go to the device once per
batch and logits come back once per batch, at the response boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylane.tracking.registry import resolve_version


@dataclass(frozen=True)
class ModelCard:
    """What a client needs to know about the served model."""

    registered_model: str
    version: int
    run_id: str | None
    input_dim: int
    num_classes: int
    input_dtype: str = "float32"


def move_exported(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """An unlifted torch.export module (`ExportedProgram.module()`) moved to `device`: its
    parameters and buffers, and the device every tensor-making node of its graph was traced
    with (`torch.export.passes.move_to_device_pass` does this on the program; MLflow hands
    out the module). In place; returned for chaining."""
    target = torch.device(device)
    module.to(target)
    for graph_module in module.modules():
        if isinstance(graph_module, torch.fx.GraphModule):
            for node in graph_module.graph.nodes:
                if "device" in node.kwargs:
                    node.kwargs = {**node.kwargs, "device": target}
            graph_module.recompile()
    return module


class Predictor:
    """A loaded model plus its card. `predict` takes raw feature rows, returns logits."""

    def __init__(self, model: torch.nn.Module, card: ModelCard, device: torch.device | str = "cpu"):
        # Models are logged in eval mode as torch.export programs (MLflow's pt2 format), which
        # keep that mode and refuse .eval(), so the mode is not set again here.
        self.model = model
        self.card = card
        self.device = torch.device(device)

    @classmethod
    def from_registry(
        cls,
        tracking_uri: str,
        registered_model: str,
        alias: str,
        version: int | None = None,
        device: torch.device | str = "cpu",
    ) -> Predictor:
        """Load `version` if given, else resolve `alias` to a version once and load that, on
        `device`."""
        import mlflow
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri)
        found = resolve_version(client, tracking_uri, registered_model, alias, version)
        mlflow.set_tracking_uri(tracking_uri)
        uri = f"models:/{registered_model}/{found.version}"
        model = move_exported(mlflow.pytorch.load_model(uri), device)
        input_dim, num_classes, input_dtype = _signature_dims(uri)
        card = ModelCard(
            registered_model,
            int(found.version),
            found.run_id,
            input_dim,
            num_classes,
            input_dtype,
        )
        return cls(model, card, device)

    @torch.no_grad()
    def predict(self, rows: np.ndarray) -> np.ndarray:
        """Logits `[N, num_classes]` for raw feature rows `[N, input_dim]`.

        Sequence models (outputs `[N, T, vocab]`) answer with the next-token logits: the last
        position's. One copy to the device and one back for the whole batch.
        """
        rows = np.ascontiguousarray(rows, dtype=self.card.input_dtype)
        outputs = self.model(torch.from_numpy(rows).to(self.device))
        if outputs.ndim == 3:
            outputs = outputs[:, -1, :]
        return outputs.to("cpu").numpy()


def _signature_dims(model_uri: str) -> tuple[int, int, str]:
    """Features per row, outputs per row and the input dtype, from the logged signature."""
    from mlflow.models import get_model_info

    signature = get_model_info(model_uri).signature
    input_spec = signature.inputs.inputs[0]
    output_shape = signature.outputs.inputs[0].shape
    return int(input_spec.shape[-1]), int(output_shape[-1]), str(input_spec.type)
