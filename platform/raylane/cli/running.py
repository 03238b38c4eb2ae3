"""How a command runs: a user's mistake met on the way reported in one line, and the command's
time on Ray."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from raylane.cli.common import fail
from raylane.cli.lazy import deferred
from raylane.config import ConfigError
from raylane.runtime import connect_ray, disconnect_ray
from raylane.serving.errors import ServedModelError
from raylane.serving.guard import ApiKeyError
from raylane.serving.leftovers import LeftoverIngressError
from raylane.tracking import TrackingError
from raylane.train.errors import CodeMismatchError

# Read only when an exception is none of the errors above: pyarrow and MLflow load then, if
# what raised has not loaded them already.
data = deferred("raylane.data")
lineage = deferred("raylane.tracking.lineage")
registry = deferred("raylane.tracking.registry")

USER_ERRORS = (
    ConfigError, TrackingError, ApiKeyError, LeftoverIngressError, ServedModelError,
    CodeMismatchError,
)  # fmt: skip


def more_user_errors() -> tuple[type[Exception], ...]:
    """The user's mistakes the data, registry and lineage modules raise."""
    return (data.DataError, registry.ModelNotFoundError, lineage.BaseModelError)


@contextmanager
def user_mistakes(*more: type[Exception]) -> Iterator[None]:
    """A user's mistake (bad config, data, store, model, key...) ends the command with one
    `error:` line naming it, not a traceback."""
    try:
        yield
    except (*USER_ERRORS, *more) as exc:
        raise fail(str(exc)) from None
    except Exception as exc:
        if isinstance(exc, more_user_errors()):
            raise fail(str(exc)) from None
        raise


@contextmanager
def on_ray(
    *more: type[Exception],
    phases=None,
    before_local_start: Callable[[], None] | None = None,
    ship: Path | None = None,
) -> Iterator[bool]:
    """One command's time on Ray: connect to $RAY_ADDRESS or start a local Ray (yielding
    whether it started one), report a user's mistake in one line, and stop a Ray it started
    however the command ends. `phases` (a PhaseClock) times the connection and shutdown;
    `ship` is what a running cluster's nodes get of the working directory (`connect_ray`)."""

    def timed(name: str):
        return phases.phase(name) if phases is not None else nullcontext()

    started = False
    try:
        with user_mistakes(*more):
            with timed("ray"):
                started = connect_ray(before_local_start=before_local_start, ship=ship)
            yield started
    finally:
        with timed("shutdown"):
            disconnect_ray(started)
