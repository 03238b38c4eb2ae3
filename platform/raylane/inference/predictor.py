"""Load a model version from the MLflow Model Registry and run batched forwards on it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class ModelNotFoundError(LookupError):
    """No registered model version matches; the message names the model, alias and store."""


@dataclass(frozen=True)
class ModelCard:
    """What a client needs to know about the served model."""

    registered_model: str
    version: int
    run_id: str | None
    input_dim: int
    num_classes: int
    input_dtype: str = "float32"


class Predictor:
    """A loaded model plus its card. `predict` takes raw feature rows, returns logits."""

    def __init__(self, model: torch.nn.Module, card: ModelCard):
        # Models are logged in eval mode as torch.export programs (MLflow's pt2 format), which
        # keep that mode and refuse .eval(), so the mode is not set again here.
        self.model = model
        self.card = card

    @classmethod
    def from_registry(cls, tracking_uri: str, registered_model: str, alias: str) -> Predictor:
        """Resolve `alias` to a version once, then load exactly that version."""
        import mlflow
        from mlflow.tracking import MlflowClient

        from raylane.tracking.registry import champion_version

        client = MlflowClient(tracking_uri=tracking_uri)
        version = champion_version(client, registered_model, alias)
        if version is None:
            raise ModelNotFoundError(
                f"no version of registered model {registered_model!r} has alias {alias!r} in "
                f"{tracking_uri}; train one first (raylane train)"
            )
        mlflow.set_tracking_uri(tracking_uri)
        uri = f"models:/{registered_model}/{version.version}"
        model = mlflow.pytorch.load_model(uri, map_location="cpu")
        input_dim, num_classes, input_dtype = _signature_dims(uri)
        card = ModelCard(
            registered_model,
            int(version.version),
            version.run_id,
            input_dim,
            num_classes,
            input_dtype,
        )
        return cls(model, card)

    @torch.no_grad()
    def predict(self, rows: np.ndarray) -> np.ndarray:
        """Logits `[N, num_classes]` for raw feature rows `[N, input_dim]`.

        Sequence models (outputs `[N, T, vocab]`) answer with the next-token logits: the last
        position's.
        """
        inputs = torch.from_numpy(np.ascontiguousarray(rows, dtype=self.card.input_dtype))
        outputs = self.model(inputs)
        if outputs.ndim == 3:
            outputs = outputs[:, -1, :]
        return outputs.numpy()


def _signature_dims(model_uri: str) -> tuple[int, int, str]:
    """Features per row, outputs per row and the input dtype, from the logged signature."""
    from mlflow.models import get_model_info

    signature = get_model_info(model_uri).signature
    input_spec = signature.inputs.inputs[0]
    output_shape = signature.outputs.inputs[0].shape
    return int(input_spec.shape[-1]), int(output_shape[-1]), str(input_spec.type)
