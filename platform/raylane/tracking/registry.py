"""Model Registry: the champion alias moves only to a version that beats it."""

from __future__ import annotations

from dataclasses import dataclass

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient


class ModelNotFoundError(LookupError):
    """No registered model version matches; the message names the model, alias and store."""


@dataclass(frozen=True)
class PromotionDecision:
    version: int
    promoted: bool
    score: float
    previous_version: int | None
    previous_score: float | None

    def describe(self, name: str, alias: str) -> str:
        if self.previous_version is None:
            return f"{name} v{self.version} is the first {alias} ({self.score:.4f})"
        verdict = "takes" if self.promoted else "does not take"
        return (
            f"{name} v{self.version} ({self.score:.4f}) {verdict} the {alias} alias from "
            f"v{self.previous_version} ({self.previous_score:.4f})"
        )


def champion_version(client: MlflowClient, name: str, alias: str):
    """The version holding `alias`, or None when no version does (or the model is missing)."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def version_score(client: MlflowClient, version, metric: str) -> float | None:
    """A version's score: its tag if set, else the metric of the run that produced it."""
    if metric in (version.tags or {}):
        return float(version.tags[metric])
    if version.run_id:
        value = client.get_run(version.run_id).data.metrics.get(metric)
        return None if value is None else float(value)
    return None


def register_if_better(
    client: MlflowClient,
    name: str,
    version: int,
    score: float,
    alias: str,
    metric: str,
    higher_is_better: bool = True,
) -> PromotionDecision:
    """Tag `version` with its score and give it `alias` if it beats the current holder (a
    higher score, or a lower one where lower is better).

    The first version becomes champion. Ties keep the current champion.
    """
    client.set_model_version_tag(name, str(version), metric, f"{score:.6f}")
    current = champion_version(client, name, alias)
    previous_score = None if current is None else version_score(client, current, metric)
    if current is None or previous_score is None:
        promoted = True
    else:
        promoted = score > previous_score if higher_is_better else score < previous_score
    if promoted:
        client.set_registered_model_alias(name, alias, str(version))
    return PromotionDecision(
        version=int(version),
        promoted=promoted,
        score=score,
        previous_version=None if current is None else int(current.version),
        previous_score=previous_score,
    )


def resolve_version(client, tracking_uri: str, name: str, alias: str, version: int | None = None):
    """The registry's ModelVersion for `version`, or for the one holding `alias`.

    Raises:
        ModelNotFoundError: with a message naming the model, version or alias, and the store.
    """
    if version is not None:
        try:
            return client.get_model_version(name, str(version))
        except MlflowException:
            raise ModelNotFoundError(
                f"registered model {name!r} has no version {version} in {tracking_uri}"
            ) from None
    found = champion_version(client, name, alias)
    if found is None:
        raise ModelNotFoundError(
            f"no version of registered model {name!r} has alias {alias!r} in "
            f"{tracking_uri}; train one first (raylane train)"
        )
    return found


def point_alias(client: MlflowClient, tracking_uri: str, name: str, alias: str, version: int):
    """Give `alias` to `version` of `name` (`raylane promote`): by hand, whatever its score.

    Raises:
        ModelNotFoundError: the version does not exist (the alias stays where it was).
    """
    resolve_version(client, tracking_uri, name, alias, version)
    client.set_registered_model_alias(name, alias, str(version))
