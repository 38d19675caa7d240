"""A user dataset factory for fault and multi-node tests: digits, plus instrumentation.

``dataset="_probe_data:slow_digits"``: digits whose training batches take at least 0.2 s to
read, in any process (a pipeline stage actor too).

``dataset="_probe_data:digits"`` with ``data_root=<probe dir>``. Inside a Ray Train worker
it writes ``worker-<rank>-<pid>.json`` (world/node/local rank, node IP, PID, start time) into the
probe dir, appends every training index it serves to ``indices-<rank>-<pid>.txt``, and
carries out the faults listed in ``plan.json``::

    [{"action": "kill_process", "rank": 1, "after_samples": 1056},
     {"action": "kill_in_save", "rank": 0, "after_saves": 1, "after": "kill_process"},
     {"action": "kill_node", "node_ip": "10.213.77.2", "after_samples": 1056}]

A fault applies to the workers whose world ``rank`` and ``node_ip`` match (either may be
left out). It happens once per probe dir (a ``done-<action>`` file records it) and is
armed in a worker process only if the fault named by ``after`` has already happened
when that process starts. Actions, after ``after_samples`` training samples served by this process:
``kill_process`` (SIGKILL itself), ``kill_node`` (SIGKILL every process of its Ray node,
those carrying its ``RTM_TEST_NODE`` marker from ``_ray_nodes.py``: a lost machine),
``stall`` (sleep an hour). A fault with ``"after_rank0_reports": N`` first waits (up to
``WAIT_FOR_REPORTS_S``) until rank 0 has handed N reports to Ray Train's result queue (each
rank-0 process records them as ``rank0-report-<k>`` files): rank 0's report of a checkpoint
is queued only once its asynchronous upload is done, so a rank killed before that may lose
the checkpoint by design (docs/reliability.md), and a test of what happens after both ranks
reported must order the kill after it. A queued report is not yet a registered checkpoint: a
test that asserts which checkpoint the restart resumes from gives ``"after_registered_step": S``
with ``"run": <run folder>`` instead, and the fault waits (as long) until Ray Train's snapshot
in that folder names a checkpoint of step S or later (:func:`registered_step`). ``kill_in_save`` lets ``after_saves`` checkpoint uploads of
this process through, then writes the next checkpoint's files into storage cut to half
their bytes (JSON files whole), records the folder in ``done-kill_in_save``, keeps a whole
copy in ``kill_in_save-whole`` (what the save would have written) and SIGKILLs itself: a kill
in the middle of a save.

``slow_uploads`` (``{"action": "slow_uploads", "rank": 0, "upload_s": 0.5, "kill_in_upload": 3}``, armed in
every process of that rank): it wraps the function Ray Train V2 copies a checkpoint to storage with
(``storage._pyarrow_fs_copy_files``, run in Ray's upload thread for an asynchronous report); each upload
sleeps ``upload_s`` first, then copies, and appends ``{"dest", "start", "end"}`` to ``uploads.jsonl``.
Upload number ``kill_in_upload`` (counted over the run, through ``uploads.jsonl``; once) instead writes half
of every file's bytes (JSON files whole), records the folder in ``done-kill_in_upload`` and SIGKILLs the
process: a failure in the middle of an upload. Every training batch such a process reads appends its time
to ``batches-<pid>.txt``.

``optimizer="_probe_data:mesh_sgd"`` with ``optimizer_kwargs={"probe": dir, "momentum": m}``: SGD over
the parameters a worker's strategy hands the optimizer; inside a Ray Train worker it first writes
``mesh-<rank>-<pid>.json`` with its node IP and, where the first parameter is a DTensor (``fsdp``), its
device mesh as torch built it: shape, dimension names, placements, the local and full shapes, and the
world ranks of its ``shard`` and ``replicate`` sub-meshes; :func:`check_hsdp_mesh` reads them back. Under
``params``, every parameter's ``[mesh dimension names, placements, local shape]`` in the model's order.

``model="_probe_data:mlp_that_dies"`` with ``model_kwargs={"probe": dir, "after_forwards": N}``:
an MLP for 8x8 digits whose last block (no parameters, so a pipeline puts it in the last
stage) SIGKILLs its process on its N-th training forward inside a Ray actor, after writing
the time to ``<probe>/died``: a stage that dies in the middle of a pipeline step.

The helpers only observe and inject faults; nothing here touches the code under test.

``fit`` ships this file to the workers (a user module outside site-packages), so it must
not import other test helpers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

from torch import nn
from torch.utils.data import Dataset

from raytrain_mgpu.data import Datasets, digits as _digits
from raytrain_mgpu.checkpointing.run_folder import RAY_TRAIN_SNAPSHOT


def digits(cfg) -> Datasets:
    data = _digits.build(cfg)
    info = _worker_info()
    if info is None or not cfg.data_root:  # on the driver (check_data), or not instrumented
        return data
    probe = Path(cfg.data_root)
    (probe / f"worker-{info['world_rank']}-{info['pid']}.json").write_text(json.dumps(info))
    sample_fault = None
    if info["world_rank"] == 0 and any("after_rank0_reports" in f for f in _plan(probe)):
        _record_reports(probe)
    times = None
    for fault in _armed(probe, info):
        if fault["action"] == "kill_in_save":
            _arm_kill_in_save(probe, fault["after_saves"])
        elif fault["action"] == "slow_uploads":
            _slow_uploads(probe, fault)
            times = probe / f"batches-{info['pid']}.txt"
        else:
            sample_fault = fault
    train = _Recording(data.train, probe / f"indices-{info['world_rank']}-{info['pid']}.txt", probe, sample_fault,
                       times)
    return data._replace(train=train)


def slow_digits(cfg) -> Datasets:
    """Digits whose training batches take at least ``SLOW_BATCH_S`` to read, in any process
    (a pipeline stage actor too): a run of a tiny model that lasts long enough for a test to
    act in the middle of an epoch."""
    data = _digits.build(cfg)
    return data._replace(train=_Slow(data.train))


SLOW_BATCH_S = 0.2  # digits at batch 64: >= 4.4 s an epoch for a test to act in


class _Slow(Dataset):
    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):
        time.sleep(SLOW_BATCH_S)
        return self.inner.__getitems__(indices)


def _plan(probe: Path) -> list:
    plan_file = probe / "plan.json"
    if not plan_file.is_file():
        return []
    plan = json.loads(plan_file.read_text())
    return plan if isinstance(plan, list) else [plan]


def _armed(probe: Path, info: dict) -> list:
    """The faults of plan.json that this worker process carries out: those whose ``rank``
    (world rank) and ``node_ip``, where given, match it, not done yet, and ready."""
    return [f for f in _plan(probe)
            if f.get("rank", info["world_rank"]) == info["world_rank"]
            and f.get("node_ip", info["node_ip"]) == info["node_ip"]
            and not (probe / f"done-{f['action']}").exists()
            and (not f.get("after") or (probe / f"done-{f['after']}").exists())]


def _worker_info():
    try:
        import ray.train

        ctx = ray.train.get_context()
        return {"world_rank": ctx.get_world_rank(), "world_size": ctx.get_world_size(),
                "node_rank": ctx.get_node_rank(), "local_rank": ctx.get_local_rank(),
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "started": time.time(),
                "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
    except Exception:  # not inside a Ray Train worker
        return None


class _Recording(Dataset):
    def __init__(self, inner, log: Path, probe: Path, plan, times: Path = None):
        self.inner, self.log, self.probe, self.plan, self.times = inner, log, probe, plan, times
        self.served = 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):
        if self.times is not None:
            with open(self.times, "a") as f:
                f.write(f"{time.time()}\n")
        with open(self.log, "a") as f:
            f.write(" ".join(str(int(i)) for i in indices) + "\n")
        self.served += len(indices)
        if self.plan and self.served > self.plan["after_samples"]:
            self._act()
        return self.inner.__getitems__(indices)

    def _act(self):
        action = self.plan["action"]
        try:  # once per probe dir, whichever process gets here first
            os.close(os.open(self.probe / f"done-{action}", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            self.plan = None
            return
        if "after_rank0_reports" in self.plan:
            _wait_for_rank0_reports(self.probe, self.plan["after_rank0_reports"])
        if "after_registered_step" in self.plan:
            _wait_for_registered_step(Path(self.plan["run"]), self.plan["after_registered_step"])
        if action == "stall":
            time.sleep(3600)
        elif action == "kill_process":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "kill_node":
            _kill_own_node()


WAIT_FOR_REPORTS_S = 300.0  # then the fault goes ahead, and the test's assertions say what was lost


def _record_reports(probe: Path) -> None:
    """Write ``rank0-report-<k>`` once this process's k-th report is in Ray Train's result queue."""
    from ray.train.v2._internal.execution.context import TrainContext

    queue_report = TrainContext._wait_then_report

    def queue_then_record(self, training_report, report_call_index):
        queue_report(self, training_report, report_call_index)
        (probe / f"rank0-report-{report_call_index}").touch()

    TrainContext._wait_then_report = queue_then_record


def _wait_for_rank0_reports(probe: Path, count: int) -> None:
    deadline = time.monotonic() + WAIT_FOR_REPORTS_S
    while len(list(probe.glob("rank0-report-*"))) < count and time.monotonic() < deadline:
        time.sleep(0.02)


def _wait_for_registered_step(run: Path, step: int) -> None:
    deadline = time.monotonic() + WAIT_FOR_REPORTS_S
    while (registered_step(run) or -1) < step and time.monotonic() < deadline:
        time.sleep(0.02)


def registered_step(run: Path):
    """The step of Ray Train's latest registered checkpoint in the run folder ``run`` (what a
    restart resumes from), or None: its controller rewrites the snapshot when it registers one."""
    try:
        snapshot = json.loads((run / RAY_TRAIN_SNAPSHOT).read_text())
        name = snapshot["latest_checkpoint_result"]["checkpoint_dir_name"]
        return json.loads((run / name / "meta.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):  # not written yet, or being replaced
        return None


def _arm_kill_in_save(probe: Path, after_saves: int) -> None:
    # Ray Train V2 uploads a reported checkpoint with this function, from the worker.
    from ray.train.v2._internal.execution import storage

    upload = storage._pyarrow_fs_copy_files
    saves = {"n": 0}

    def upload_then_die(source, destination, source_filesystem=None, destination_filesystem=None, **kwargs):
        saves["n"] += 1
        if saves["n"] <= after_saves:
            return upload(source, destination, source_filesystem=source_filesystem,
                          destination_filesystem=destination_filesystem, **kwargs)
        fd = os.open(probe / "done-kill_in_save", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.write(fd, str(destination).encode())
        os.close(fd)
        shutil.copytree(source, probe / "kill_in_save-whole")  # what the save would have written
        _write_half_then_die(source, destination, destination_filesystem)

    storage._pyarrow_fs_copy_files = upload_then_die


def _write_half_then_die(source, destination, destination_filesystem) -> None:
    """A checkpoint upload killed half-way: every file cut to half its bytes (JSON files whole), then SIGKILL."""
    for name in sorted(os.listdir(source)):
        data = Path(source, name).read_bytes()
        with destination_filesystem.open_output_stream(f"{destination}/{name}") as f:
            f.write(data if name.endswith(".json") else data[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)


def _slow_uploads(probe: Path, plan: dict) -> None:
    from ray.train.v2._internal.execution import storage

    upload = storage._pyarrow_fs_copy_files
    log = probe / "uploads.jsonl"

    def slow_upload(source, destination, source_filesystem=None, destination_filesystem=None, **kwargs):
        number = 1 + (len(log.read_text().splitlines()) if log.exists() else 0)
        start = time.time()
        if number == plan.get("kill_in_upload") and not (probe / "done-kill_in_upload").exists():
            (probe / "done-kill_in_upload").write_text(str(destination))
            _write_half_then_die(source, destination, destination_filesystem)
        time.sleep(plan.get("upload_s", 0.0))
        result = upload(source, destination, source_filesystem=source_filesystem,
                        destination_filesystem=destination_filesystem, **kwargs)
        with open(log, "a") as f:
            f.write(json.dumps({"dest": str(destination), "start": start, "end": time.time()}) + "\n")
        return result

    storage._pyarrow_fs_copy_files = slow_upload


def _kill_own_node():
    marker = os.environ.get("RTM_TEST_NODE")
    if not marker:
        raise RuntimeError("kill_node needs a node started by _ray_nodes.RayNode (RTM_TEST_NODE unset)")
    needle = f"RTM_TEST_NODE={marker}".encode() + b"\0"
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                continue
    os.kill(os.getpid(), signal.SIGKILL)


def mlp_that_dies(input_shape, num_classes, probe: str, after_forwards: int) -> nn.Module:
    features = 1
    for size in input_shape:
        features *= size
    return nn.Sequential(nn.Flatten(), nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, num_classes),
                         _DieOnForward(Path(probe), after_forwards))


class _DieOnForward(nn.Module):
    def __init__(self, probe: Path, after_forwards: int):
        super().__init__()
        self.probe, self.after_forwards, self.forwards = probe, after_forwards, 0

    def forward(self, x):
        if self.training and _in_ray_actor():
            self.forwards += 1
            if self.forwards == self.after_forwards:
                (self.probe / "died").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
        return x


def _in_ray_actor() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


def param_layout(param) -> list:
    """``[mesh dimension names, placements, local shape]`` of a DTensor; a plain tensor's ``[[], [], shape]``."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return [[], [], list(param.shape)]
    return [list(mesh.mesh_dim_names or ()), [str(p) for p in param.placements], list(param.to_local().shape)]


def mesh_sgd(params, lr: float, probe: str, momentum: float = 0.0):
    """A user's optimizer factory that records the device mesh its parameters were sharded on."""
    import torch

    params = list(params)
    info = _worker_info()
    if info is not None:
        facts = {"world_rank": info["world_rank"], "node_ip": info["node_ip"]}
        first = params[0]
        mesh = getattr(first, "device_mesh", None)  # a DTensor's; a plain tensor has none
        if mesh is not None:
            names = list(mesh.mesh_dim_names or ())
            facts.update(mesh=list(mesh.mesh.shape), dims=names, placements=[str(p) for p in first.placements],
                         local=list(first.to_local().shape), full=list(first.shape),
                         **{f"{name}_group": mesh[name].mesh.tolist() for name in names})
        # every parameter, in the order the model holds them: its mesh's dimension names, placements, local shape
        facts["params"] = [param_layout(p) for p in params]
        (Path(probe) / f"mesh-{info['world_rank']}-{info['pid']}.json").write_text(json.dumps(facts))
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def check_hsdp_mesh(probe: Path, workers: int, shard: int) -> dict:
    """Assert what :func:`mesh_sgd` recorded for an HSDP run (``shard_group_size=shard``): every rank's
    parameters are DTensors on a (replicas x shard) mesh, replicated over the first dimension and sharded
    over the second; its shard group is ``shard`` consecutive ranks, its replicate group the ranks at its
    place in the other groups; it holds 1/shard of the first weight (not 1/workers). Returns the facts by
    rank (one dict per worker process: a resumed run has several)."""
    facts = {}
    for path in Path(probe).glob("mesh-*.json"):
        fact = json.loads(path.read_text())
        facts.setdefault(fact["world_rank"], []).append(fact)
    assert sorted(facts) == list(range(workers)), sorted(facts)
    for rank, seen in facts.items():
        for fact in seen:
            group = rank // shard
            assert fact["mesh"] == [workers // shard, shard] and fact["dims"] == ["replicate", "shard"], fact
            assert fact["placements"] == ["R", "S(0)"], fact  # Replicate() over the groups, Shard(0) within
            assert fact["shard_group"] == [group * shard + i for i in range(shard)], fact
            assert fact["replicate_group"] == [g * shard + rank % shard for g in range(workers // shard)], fact
            assert fact["local"] == [fact["full"][0] // shard, *fact["full"][1:]], fact
    return facts
