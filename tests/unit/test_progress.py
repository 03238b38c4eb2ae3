from raylane.train.progress import format_epoch


def test_an_epoch_line_has_the_numbers_that_matter_and_an_eta():
    line = format_epoch(
        2,
        10,
        {
            "train_loss": 0.41234,
            "val_loss": 0.38,
            "val_accuracy": 0.912,
            "train_samples_per_s": 1234.4,
        },
        12.0,
        4.0,
    )
    assert line == (
        "epoch 3/10  train_loss 0.4123  val_loss 0.3800  val_accuracy 0.9120  "
        "1,234 samples/s  12 s elapsed  ETA 28 s"
    )


def test_the_last_epoch_has_no_eta_and_missing_metrics_are_left_out():
    line = format_epoch(4, 5, {"val_loss": 1.0}, 50.0, 3.0)
    assert line == "epoch 5/5  val_loss 1.0000  50 s elapsed"


def test_no_eta_before_the_epoch_rate_is_known():
    assert "ETA" not in format_epoch(0, 5, {"val_loss": 1.0}, 50.0)


def test_a_gpu_run_shows_its_largest_workers_device_peak():
    metrics = {"val_loss": 1.0, "train_samples_per_s": 512.0, "worker_device_peak_mb": 13912.4}
    line = format_epoch(0, 2, metrics, 9.0)
    assert line == "epoch 1/2  val_loss 1.0000  512 samples/s  GPU peak 13,912 MB  9 s elapsed"


def test_inside_an_epoch_a_line_every_interval_with_the_last_intervals_rate():
    """A fake clock: steps of 0.5 s (0.1 s of it waiting for data), a line every 2 s."""
    from raylane.train.progress import ProgressTicker, format_progress

    now = [0.0]
    said = []
    ticker = ProgressTicker(2.0, said.append, global_batch=32, clock=lambda: now[0])
    ticker.start(epoch=1, steps=20)
    for step in range(9):
        now[0] += 0.5
        ticker.step_done(step, data_wait_s=0.1)
    assert [record["step"] for record in said] == [4, 8]  # at 2 s and 4 s, not before
    first = said[0]
    assert first["samples_per_s"] == 4 * 32 / 2.0 and first["data_wait_share"] == 0.2
    assert format_progress(first) == (
        "  epoch 2, step 4/20  64 samples/s  data wait 20 %  8 s left in the epoch"
    )
    unknown = {**first, "steps": None}  # a Ray Data shard's length is not counted ahead
    assert format_progress(unknown) == "  epoch 2, step 4  64 samples/s  data wait 20 %"
    quiet = ProgressTicker(0.0, said.append, global_batch=32, clock=lambda: now[0])
    quiet.start(epoch=0, steps=None)
    now[0] += 100.0
    quiet.step_done(0, 0.0)
    assert len(said) == 2  # training.progress_every_s: 0 says nothing inside an epoch
