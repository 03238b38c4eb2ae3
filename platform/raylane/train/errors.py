"""The one-line errors a training job's driver raises for what its workers found."""

#: What a worker's error says when the group imported different raylane sources.
CODE_MISMATCH = "workers run different raylane code"


class CodeMismatchError(RuntimeError):
    """Workers imported different raylane sources; the message names the nodes."""
