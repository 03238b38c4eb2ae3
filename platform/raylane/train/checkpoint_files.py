"""The names of a raylane checkpoint's files (`raylane.train.checkpointing` writes them), here
without torch: the driver checks that a resume path holds a checkpoint before Ray starts."""

META_FILE = "meta.json"
SHARDED_DIR = "sharded"
