"""Everything MLflow: the tracking store, runs, the cluster snapshot, and the Model Registry."""

from raylane.tracking.store import TrackingError, check_tracking_reachable, resolve_tracking_uri

__all__ = ["TrackingError", "check_tracking_reachable", "resolve_tracking_uri"]
