"""`raylane tune`'s written winner: only what differs from the defaults, loading to the same
config as the full one (`raylane plan`'s way of writing configs)."""

from pathlib import Path

from raylane.config import load_config
from raylane.tune.candidates import enumerate_candidates, trial_config
from raylane.tune.report import write_best_config
from raylane.tune.search import TrialOutcome
from raylane.tune.spec import TuneSpec

ROOT = Path(__file__).resolve().parents[2]


def test_the_best_config_is_short_and_loads_to_the_full_winner(tmp_path):
    spec = TuneSpec.model_validate({
        "experiment": "lm-best", "base": str(ROOT / "configs" / "train" / "lm_pipeline.yaml"),
        "base_overrides": ["data.max_bytes=131072"],
        "search": {"strategy": ["hybrid"], "workers": [4], "pp": [2], "microbatches": [4],
                   "batch_size": [16]},
        "constraints": {"cpus": 2.0, "cpus_per_worker": 0.45},
    })  # fmt: skip
    (winner,), _ = enumerate_candidates(spec)
    path = write_best_config(spec, TrialOutcome(winner, "ok", samples_per_s=12.5), tmp_path / "b")

    full = trial_config(spec, winner, for_trial=False)
    written = load_config(path)
    assert written == full  # every field, defaults included
    assert (written.parallelism.strategy, written.parallelism.dp, written.parallelism.pp) == (
        "hybrid", 2, 2,
    )  # fmt: skip
    assert written.training.steps_per_epoch == full.training.steps_per_epoch  # not the trial's
    text = path.read_text()
    assert "12.5 samples/s" in text and "hybrid-w4" in text
    body = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    full_lines = len(full.model_dump_json(indent=1).splitlines())
    assert len(body) < 60 and len(body) * 4 < full_lines, (len(body), full_lines)
    # Fields at their defaults are left out: the serving section of the base is all defaults
    # but its model name and port.
    assert "max_queued_requests" not in text and "surge_percent" not in text
