import logging

from mlflow.tracking import MlflowClient

from raylane.tracking.runs import EpochLogger


def test_an_epoch_that_ends_again_after_a_restart_is_logged_once(tmp_path, caplog):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("restarts")).info.run_id

    caplog.set_level(logging.INFO, logger="raylane")
    first = EpochLogger(uri, run_id)
    assert first.log_epoch({"val_loss": 2.0, "global_step": 44}, 0, again=True)  # none held
    # The group restarts from a checkpoint taken before epoch 0's end (a new logger, as in
    # the new group's rank 0), trains the last steps again and ends epoch 0 a second time.
    again = EpochLogger(uri, run_id)
    assert not again.log_epoch({"val_loss": 2.1, "global_step": 44}, 0, again=True)
    assert "epoch 1 ended again after a restart" in caplog.text
    assert again.log_epoch({"val_loss": 1.5, "global_step": 88}, 1)

    history = client.get_metric_history(run_id, "global_step")
    assert [(m.step, m.value) for m in history] == [(0, 44.0), (1, 88.0)]
    assert [m.value for m in client.get_metric_history(run_id, "val_loss")] == [2.0, 1.5]


def test_only_the_epoch_a_group_starts_in_is_checked_and_an_unreachable_store_skips_nothing(
    tmp_path, monkeypatch, caplog
):
    # Each query opens the database file anew, so a store whose directory is moved away is
    # unreachable to reads and writes alike until it is moved back.
    monkeypatch.setenv("MLFLOW_SQLALCHEMYSTORE_POOLCLASS", "NullPool")
    store = tmp_path / "store"
    uri = f"sqlite:///{store / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("resumed")).info.run_id
    logger = EpochLogger(uri, run_id)
    logger.log_epoch({"val_loss": 2.0}, 0)
    # An epoch past the one the group started in is always logged (a run resumed from an
    # older checkpoint records what it trains).
    assert logger.log_epoch({"val_loss": 1.9}, 0, again=False)
    assert len(client.get_metric_history(run_id, "val_loss")) == 2
    # A store that cannot say what it holds: a restarted group's epoch is logged (it waits
    # for the store like any epoch), never dropped as one the run already has.
    caplog.set_level(logging.WARNING, logger="raylane")
    store.rename(tmp_path / "away")
    assert logger.log_epoch({"val_loss": 1.8}, 0, again=True)
    assert "metrics are kept and sent when it is back" in caplog.text
    (tmp_path / "away").rename(store)
    assert logger.log_epoch({"val_loss": 1.5}, 1)  # the store is back: both go out
    history = client.get_metric_history(run_id, "val_loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 1.8), (0, 1.9), (0, 2.0), (1, 1.5)]
