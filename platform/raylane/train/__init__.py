"""Ray Train jobs: the per-worker loop, the trainer builder, and the driver-side job."""
