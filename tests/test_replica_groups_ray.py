"""Replica groups through Ray Train (``fault_tolerance="replica_groups"``): a worker process killed (SIGKILL) after
its step 200 of 1,000 is replaced by Ray Train while the other worker trains on, and the run ends with an
uninterrupted run's accuracy. Its loop semantics (healing, the average, the rows) are tests/test_replica_groups.py's,
without Ray; what a lost worker costs in wall time, both ways, is ``raytrain-mgpu bench-lost-worker``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import raytrain_mgpu as rtm

pytest.importorskip("torchft")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_worker_is_replaced_while_the_other_never_stops(ray_session, tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    # rank 1 dies after its step 200; rank 0 waits after its step 400 until the replacement exists (bounded), so
    # that the run cannot end before it joins on a slow machine
    (probe / "kill.json").write_text(json.dumps({"rank": 1, "step": 200, "park": {"rank": 0, "step": 400}}))
    result = rtm.fit(rtm.TrainConfig(
        model="mlp", dataset="_replica_probe:killing_digits", data_root=str(probe), strategy="ddp", num_workers=2,
        use_gpu=False, runner="ray", epochs=23, max_steps=1000, batch_size=32, lr=0.05,
        fault_tolerance="replica_groups", max_failures=2, storage_path=str(tmp_path / "runs"), name="rg-ray"))
    workers = [json.loads(p.read_text()) for p in probe.glob("worker-*.json")]
    by_rank = {rank: sorted(w["pid"] for w in workers if w["rank"] == rank) for rank in (0, 1)}
    assert len(by_rank[0]) == 1 and len(by_rank[1]) == 2, by_rank  # 3 worker processes: rank 0 never restarted
    assert (probe / "killed-1").exists()
    history = result.history
    assert history[-1]["step"] == 1000 and history[-1]["epoch"] == 23, history[-1]
    alone = sum(row["short_steps"] for row in history)
    assert alone >= 200, [row["short_steps"] for row in history]  # rank 0 alone from its step 201 until step 400 at least
    assert history[-1]["short_steps"] == 0, history[-1]  # the replacement rejoined
    assert result.goodput["short_steps"] == alone
    assert history[-1]["test_accuracy"] > 0.9, history[-1]
    assert Path(result.checkpoint_path).name == "checkpoint_epoch000023"
