"""Hyperparameter search with Ray Tune (``raytrain_mgpu/tune.py``): a real ``tune.Tuner`` with a grid and
ASHA on the shared Ray; the search's inputs checked in one process."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

import raytrain_mgpu as rtm
from raytrain_mgpu.cli import main
from raytrain_mgpu.checkpointing.run_folder import PUBLISHED_KEY, RAY_TRAIN_SNAPSHOT, RunFolder
from raytrain_mgpu.tune import max_concurrent_trials, parse_param, search, trainable

SMALL = dict(model="mlp", model_kwargs={"widths": [32]}, dataset="digits", batch_size=64, optimizer="sgd",
             val_fraction=0.2, epochs=4, num_workers=1, use_gpu=False)


def test_params_read_as_tune_search_spaces_and_bad_ones_name_the_fix():
    from ray.tune.search.sample import Categorical, Float, Integer

    name, space = parse_param("lr=loguniform:1e-4:1e-1")
    assert name == "lr" and isinstance(space, Float) and (space.lower, space.upper) == (1e-4, 1e-1)
    assert parse_param("batch_size=grid:32,64") == ("batch_size", {"grid_search": [32, 64]})
    name, space = parse_param("optimizer=choice:sgd,adamw")
    assert isinstance(space, Categorical) and space.categories == ["sgd", "adamw"]
    assert isinstance(parse_param("grad_accum_steps=randint:1:4")[1], Integer)
    for text, error in (("lr", "not of the form NAME=KIND:VALUES"), ("lr=normal:0:1", "not of the form"),
                        ("learning_rate=uniform:0:1", "'learning_rate' is not a TrainConfig field"),
                        ("lr=loguniform:0:1", "LOW:HIGH numbers with LOW < HIGH and LOW > 0"),
                        ("lr=uniform:1:0", "LOW:HIGH numbers with LOW < HIGH")):
        with pytest.raises(ValueError, match=error):
            parse_param(text)


def test_concurrent_trials_are_the_runs_the_cluster_holds_at_once():
    cfg = rtm.TrainConfig(**SMALL, cpus_per_worker=2)
    assert max_concurrent_trials(cfg, {"CPU": 4.0}) == 2 and max_concurrent_trials(cfg, {"CPU": 3.0}) == 1
    gpu = rtm.TrainConfig(**{**SMALL, "num_workers": 2, "use_gpu": True})  # 2 x (1 CPU, 1 GPU)
    assert max_concurrent_trials(gpu, {"CPU": 16.0, "GPU": 4.0}) == 2
    assert max_concurrent_trials(rtm.TrainConfig(strategy="auto"), {"CPU": 64.0}) == 1  # each trial takes the cluster


def test_epochs_reach_tune_once_checkpointed_and_the_last_one_once_fit_has_returned(monkeypatch):
    """ASHA stops a trial at its last report (max_t), killing its process: were that report sent before fit
    returned, Ray Train's workers could be killed holding their placement group, and the next trial waited
    for the CPUs for ever (a CI run, where Ray Train's cleaner could not reach the state API)."""
    from ray import tune

    from raytrain_mgpu.tune import _ReportEpochs

    told = []
    monkeypatch.setattr(tune, "report", lambda metrics: told.append(metrics["epoch"]))
    reporter = _ReportEpochs(epochs=2)
    reporter.on_epoch_end(1, {"epoch": 1, "val_accuracy": 0.5})
    assert told == []  # not before its checkpoint is in the run folder
    reporter.on_checkpoint("/run/checkpoint_1")
    reporter.on_epoch_end(2, {"epoch": 2, "val_accuracy": 0.9})
    reporter.on_checkpoint("/run/checkpoint_2")
    assert told == [1]  # the last epoch waits for fit to return
    reporter.on_train_end(None)
    assert told == [1, 2]


def test_the_cli_refuses_a_metric_the_run_does_not_record_before_ray(capsys, monkeypatch):
    import raytrain_mgpu.driver.cluster as cluster

    monkeypatch.setattr(cluster, "connect", lambda *a, **k: pytest.fail("tune connected to Ray before refusing"))
    assert main(["tune", "--param", "lr=loguniform:1e-3:1e-1", "--metric", "val_accuracy", "--epochs", "2"]) == 2
    assert "--metric 'val_accuracy': not a history key of this run (train_loss, train_accuracy, test_loss, " \
           "test_accuracy). Pick one of them, or leave --metric out for test_accuracy." in capsys.readouterr().err


@pytest.mark.parametrize("changes, metric, mode", [
    ({}, "test_accuracy", "max"),  # tune's defaults: a key every run has, and accuracy is maximised
    ({"val_fraction": 0.1}, "val_accuracy", "max"),
    ({"monitor": "test_loss"}, "test_loss", "min"),
    ({"metrics": ["mae"], "dataset": "synthetic"}, "test_loss", "min"),  # no accuracy recorded: the loss
    ({"mode": "min", "val_fraction": 0.1}, "val_accuracy", "min"),  # the user's word wins
])
def test_tune_ranks_by_a_key_every_run_has_and_its_mode_follows_the_key(monkeypatch, changes, metric, mode):
    import raytrain_mgpu.driver.cluster as cluster

    class Stop(Exception):
        pass

    seen = {}

    def tuner(trainable, param_space, tune_config, run_config):
        seen.update(metric=tune_config.metric, mode=tune_config.mode)
        raise Stop

    monkeypatch.setattr(cluster, "connect", lambda *a, **k: False)
    monkeypatch.setattr("ray.tune.Tuner", tuner)
    monkeypatch.setattr("raytrain_mgpu.tune.trainable", lambda cfg: None)
    monkeypatch.setattr("raytrain_mgpu.tune.max_concurrent_trials", lambda cfg: 1)
    with pytest.raises(Stop):
        search(rtm.TrainConfig(**changes), ["lr=grid:0.05,0.000001"])
    assert seen == {"metric": metric, "mode": mode}


@pytest.mark.ray
def test_asha_over_a_grid_stops_the_hopeless_trial_and_returns_the_best(ray_session, tmp_path):
    # One trial at a time (a run is planned at 3 of the shared Ray's 4 CPUs: max_concurrent_trials), in the grid's
    # order: the good rate reaches every epoch; the hopeless one (lr 1e-6) is behind at the first rung and ASHA
    # stops it there. Each trial has one worker, so it trains inside its trial actor (the in-process runner).
    cfg = rtm.TrainConfig(**SMALL, cpus_per_worker=3, storage_path=str(tmp_path), name="search")
    out = io.StringIO()
    # no metric and no mode: the default metric (val_accuracy, with val_fraction) is maximised, as it follows the key
    results = search(cfg, ["lr=grid:0.1,0.000001"], trials=1, stream=out)
    by_lr = {r.config["lr"]: r for r in results}
    assert sorted(by_lr) == [1e-6, 0.1] and not any(r.error for r in results), [r.error for r in results]
    good, hopeless = by_lr[0.1], by_lr[1e-6]
    assert good.metrics["epoch"] == 4 and good.metrics["val_accuracy"] > 0.8  # every epoch, reported per epoch
    assert hopeless.metrics["epoch"] < 4 and hopeless.metrics["val_accuracy"] < 0.5  # stopped early
    assert results.get_best_result().config == {"lr": 0.1}
    # each trial is a run folder of its own ({name}-{trial id}), with its checkpoints (a stopped trial's workers
    # may have finished an epoch or two more before its process ended)
    for result in results:
        path = Path(tmp_path) / f"search-{result.metrics['trial_id']}"
        run = RunFolder(str(path))
        assert run.newest_checkpoint() is not None and run.state().epoch >= result.metrics["epoch"]
        # trained in the trial's actor: checkpoints published in the folder by the in-process runner, no Ray Train
        # run (which would leave its snapshot)
        assert run.newest_checkpoint().meta.get(PUBLISHED_KEY) is True
        assert not (path / RAY_TRAIN_SNAPSHOT).exists()
    table = out.getvalue()
    assert table.splitlines()[0] == "trial | lr | epochs | val_accuracy" and len(table.splitlines()) == 4
    assert "best (highest val_accuracy): {'lr': 0.1} val_accuracy=" in table


def test_a_trials_own_process_holds_no_cpu_so_a_run_that_takes_every_cpu_still_starts(monkeypatch):
    # 2 workers of 1 CPU on a 2-CPU Ray (tune's defaults on a 2-core machine): with 0.01 CPU for the trial's own
    # process the run's bundles never fit beside it. Measured with Ray 2.60: a trial holding {"CPU": 0, "memory": 1}
    # places a 2 x 1-CPU group on a 2-CPU instance at once.
    seen = {}
    monkeypatch.setattr("ray.tune.with_resources", lambda fn, resources: seen.update(resources) or fn)
    trainable(rtm.TrainConfig(num_workers=2, use_gpu=False))
    assert seen.get("CPU", 0) == 0 and seen
