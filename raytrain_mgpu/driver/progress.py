"""What the user sees on the driver: a start banner, a live bar, one line per epoch.

Workers never print. Rank 0 sends events to the run's ``ProgressSink`` (a channel in a zero-CPU actor on the
driver's node); a driver thread (``SinkPump``) drains it and hands them on. A rank in the driver's own process hands
them over directly (``DirectSink``). Both are opened by the attempt driver (``transports/attempt.py``) for ``fit``'s
``driver.callbacks.RunEvents`` (the ``ProgressPrinter``, the loggers and callbacks) and goodput ledger.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_mgpu.driver.heartbeat import fail_stuck
from raytrain_mgpu.engine.liveness import Beat, Judge

logger = logging.getLogger(__name__)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


_SHORT = {"accuracy": "acc"}  # the line's name for a metric, where it differs
WINDOW_PREFIX = "train/"  # every scalar of a step window (engine/step_scalars.StepWindow.read) starts with it


def _number(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def metric_names(row: dict) -> list:
    """The metrics a history row reports (``train_<name>``), in its order; accuracy only where measured."""
    return [key[len("train_"):] for key, value in row.items()
            if key.startswith("train_") and key != "train_loss" and (key != "train_accuracy" or value is not None)]


class ProgressPrinter:
    """Renders progress to a stream (the CLI's stdout by default)."""

    def __init__(self, total_epochs: int, stream=None, live: Optional[bool] = None):
        self.stream = stream or sys.stdout
        self.total_epochs = total_epochs
        self.live = self.stream.isatty() if live is None else live
        self._bar_shown = False

    def banner(self, text: str) -> None:
        if self._bar_shown:  # a line in the middle of an epoch (a preemption notice) replaces the bar
            self._write("\r" + " " * 70 + "\r")
            self._bar_shown = False
        self._write(text + "\n")

    def step(self, step: int, total: int, epoch: int = 0) -> None:
        if not self.live or total <= 0:
            return
        width = 30
        done = int(width * min(step, total) / total)
        self._write(f"\r  epoch {epoch} [{'#' * done}{'.' * (width - done)}] {step}/{total} steps")
        self._bar_shown = True

    def scalars(self, step: int, values: dict) -> None:
        """Rank 0's per-step scalars (``train/loss``, ...) at global ``step``: not shown on the line."""

    def checkpoint(self, path: str) -> None:
        """A checkpoint was persisted: not shown (the run's folder is in the banner)."""

    def epoch(self, m: dict) -> None:
        if self._bar_shown:
            self._write("\r" + " " * 70 + "\r")
            self._bar_shown = False
        memory = m.get("peak_memory_bytes") or []
        mem = f"mem/device {_mib(max(memory))}" + (f" (min {_mib(min(memory))})" if len(memory) > 1 else "") if memory else ""
        names = metric_names(m)
        train = "".join(f"{_SHORT.get(name, name)} {_number(m[f'train_{name}'])}  " for name in names
                        if name != "accuracy")  # the train accuracy of a run that has one stays off the line, as before
        test = "".join(f"{split}_loss {m[f'{split}_loss']:.4f}  " + "".join(
            f"{split}_{_SHORT.get(name, name)} {_number(m.get(f'{split}_{name}'))}  " for name in names)
            for split in ("val", "test") if m.get(f"{split}_loss") is not None)  # the evaluated splits
        restart = f"  [restart {m['attempt']}]" if m.get("attempt") else ""
        # where the epoch's time went: in steps (what samples/s is of), in checkpoints, in evaluation
        times = (f"train {m['training_s']:.2f} s  ckpt {m['checkpoint_s']:.2f} s  eval {m.get('eval_s') or 0:.2f} s  "
                 if m.get("checkpoint_s") is not None and m.get("training_s") is not None else "")
        self._write(f"epoch {m['epoch']:>3}/{self.total_epochs}  step {m['step']:>6}  "
                    f"loss {m['train_loss']:.4f}  {train}{test}"
                    f"{m['samples_per_s']:,.0f} samples/s  {times}{mem}{restart}\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


class ProgressSink:
    """One run's channel in the driver's mailbox: rank 0 sends events in (``put.remote(kind, payload)``), the
    driver's :class:`SinkPump` takes them out (``drain.remote()``), as with an actor's methods.

    The mailbox is a zero-CPU actor on the driver's node. A driver's first run starts it and its later runs on the
    same Ray reuse it, each with a channel of its own, closed at its end (events a killed worker sends later are
    dropped): an actor is a Ray worker process, about 1.3 CPU-s to start and run on a 2-core machine, which a
    driver running ``fit`` in a loop (a notebook, a sweep, this project's test suite with ~60 runs) paid for every
    run. On the driver's node because anywhere else it would die with that node: a lost spot node took every later
    progress line (epochs, "resuming at step S") with it, although the run went on (tests/test_two_node_spot.py).
    """

    _mailbox: Optional[tuple] = None  # (the Ray and node it runs for, its handle)
    OPEN_TIMEOUT_S = 60.0

    def __init__(self, mailbox, channel: str):
        self.mailbox, self.channel = mailbox, channel

    @classmethod
    def open(cls) -> "ProgressSink":
        """A new channel, in the driver's mailbox (started here if this driver has none on this Ray, or
        it died)."""
        context = ray.get_runtime_context()
        here = context.get_node_id()
        key = (context.get_job_id(), here)
        channel = uuid.uuid4().hex
        if cls._mailbox is not None and cls._mailbox[0] == key:
            try:
                ray.get(cls._mailbox[1].open.remote(channel), timeout=cls.OPEN_TIMEOUT_S)
                return cls(cls._mailbox[1], channel)
            except Exception:  # the mailbox died (or never answers): a new one
                pass
        # Hard affinity: with soft=True a busy head raylet spilled the lease back to a worker node
        # (seen on the namespace nodes); the driver's own node is alive as long as the driver is.
        mailbox = _Mailbox.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()
        mailbox.open.remote(channel)  # before any put: an actor runs its calls in order
        cls._mailbox = (key, mailbox)
        return cls(mailbox, channel)

    @property
    def put(self) -> "_ChannelMethod":
        return _ChannelMethod(self.mailbox.put, self.channel)

    @property
    def drain(self) -> "_ChannelMethod":
        return _ChannelMethod(self.mailbox.drain, self.channel)

    def close(self) -> None:
        """The run is over: its channel goes, with any event still in it (the driver drained the last ones)."""
        try:
            self.mailbox.close.remote(self.channel)
        except Exception:  # the mailbox is gone already
            pass


class _ChannelMethod:
    """A mailbox method bound to one channel: ``.remote(*args)`` calls it with the channel first."""

    def __init__(self, method, channel: str):
        self.method, self.channel = method, channel

    def remote(self, *args):
        return self.method.remote(self.channel, *args)


@ray.remote(num_cpus=0)
class _Mailbox:
    """The driver's mailbox (see :class:`ProgressSink`): events per channel, in arrival order."""

    def __init__(self):
        self.channels = {}

    def open(self, channel: str) -> None:
        self.channels[channel] = []

    def put(self, channel: str, kind: str, payload) -> None:
        if channel in self.channels:  # a closed run's late events are dropped
            self.channels[channel].append((kind, payload))

    def drain(self, channel: str) -> list:
        events = self.channels.get(channel, [])
        if channel in self.channels:
            self.channels[channel] = []
        return events

    def close(self, channel: str) -> None:
        self.channels.pop(channel, None)


class WorkerReporter:
    """Used by rank 0 on a worker: fire-and-forget, step events throttled; :meth:`flush` at the run's end."""

    FLUSH_TIMEOUT_S = 30.0
    _KEEP = 64  # sends kept unconfirmed before the confirmed ones are let go

    def __init__(self, sink, min_interval_s: float = 0.5):
        self.sink, self.min_interval_s = sink, min_interval_s
        self._last, self._reached = 0.0, None  # _reached: the last step (global) and when it ended
        self._sent: list = []  # the sends not yet known to be in the mailbox

    def _send(self, kind: str, payload) -> None:
        if self.sink is None:
            return
        sent = self.sink.put.remote(kind, payload)
        if not isinstance(sent, ray.ObjectRef):  # a sink outside Ray (tests' recorders): delivered already
            return
        self._sent.append(sent)
        if len(self._sent) > self._KEEP:
            _, self._sent = ray.wait(self._sent, num_returns=len(self._sent), timeout=0)

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Wait until every event sent so far is in the mailbox. The driver drains it a last time when the run's
        workers have returned, and a send is a call from this worker, not ordered with the driver's drain: the
        last checkpoint's announcement, sent just before the return, once came after that drain and was lost
        (seen on a pipeline's last stage under load). Never raises: progress must not fail training."""
        sent, self._sent = self._sent, []
        try:
            if sent:
                ray.wait(sent, num_returns=len(sent), timeout=timeout_s)
        except Exception:
            logger.debug("progress events not confirmed", exc_info=True)

    def step(self, step: int, total: int, epoch: int = 0) -> None:
        now = time.monotonic()
        self._reached = ((epoch - 1) * total + step, time.time())  # the global step: ended() sends the last one
        if self.sink is not None and now - self._last >= self.min_interval_s:
            self._last = now
            self._send("step", (step, total, epoch))

    def scalars(self, step: int, values: dict) -> None:
        """Every ``log_every_n_steps`` steps (the caller decides): not throttled, every call is sent."""
        self._send("scalars", (step, values))

    def epoch(self, metrics: dict) -> None:
        self._send("epoch", metrics)

    def checkpoint(self, path: str) -> None:
        """The path or URI of the checkpoint Ray Train has just persisted (sent after its epoch)."""
        self._send("checkpoint", path)

    def notice(self, line: str) -> None:
        """One line for the driver to print as it is (a preemption, a resume: ``checkpointing/preemption.py``)."""
        self._send("notice", line)

    def startup(self, entered: float, first_step: float, resumed_from: Optional[str] = None) -> None:
        """When (``time.time()``) the train function was entered and its first step began, and the checkpoint it
        resumed from: the driver keeps the first attempt's (``TrainResult.startup``). The next step's event is sent."""
        self._last, self._reached = 0.0, None
        self._send("startup", {"entered": entered, "first_step": first_step, "resumed_from": resumed_from})

    def ended(self) -> None:
        """The attempt ends here (trained, or failing): its last step, never throttled (``driver/goodput.py``)."""
        if self._reached is not None:
            self._send("reached", {"step": self._reached[0], "at": self._reached[1], "finished": time.time()})


def deliver(kind: str, payload, printer) -> None:
    """A rank's event (``WorkerReporter``'s kinds) to the driver's ``RunEvents`` (or a printer)."""
    if kind == "epoch":
        printer.epoch(payload)
    elif kind == "scalars":
        printer.scalars(*payload)
    elif kind == "checkpoint":
        printer.checkpoint(payload)
    elif kind == "notice":
        printer.banner(payload)
    elif kind == "step":
        printer.step(*payload)


class DirectSink:
    """The run's channel where rank 0 is the driver's own process (the in-process runner): ``put.remote(kind,
    payload)`` hands the event straight to the driver's ``RunEvents``, as the pump would; a callback's error is
    raised in the rank, which is the driver. ``startup``: the first start-up times; ``ledger``: the goodput's."""

    def __init__(self, events, ledger=None):
        self.events, self.startup, self.record = events, None, getattr(ledger, "event", lambda kind, payload: None)
        self.put = self

    def remote(self, kind: str, payload) -> None:
        self.record(kind, payload)
        if kind == "startup":
            self.startup = self.startup or payload
        elif kind != "beat":
            deliver(kind, payload, self.events)


class SinkPump:
    """Driver thread: moves events from the sink to the printer (a ``RunEvents``) until stopped.

    ``failure``: the exception the printer raised for an event (a callback's, named by
    ``RunEvents``), or None; the events after it are dropped and the runner re-raises it.
    """

    def __init__(self, sink, printer: ProgressPrinter, interval_s: float = 0.25, scalar_sources: int = 1,
                 stall_timeout_s: Optional[float] = 0, ledger=None):
        """``stall_timeout_s``: the ranks' heartbeats are judged (``engine/liveness.py``; None: the default
        threshold, 0: not judged); ``ledger``: every event is also recorded there (``driver/goodput.py``)."""
        self.sink, self.printer, self.interval_s = sink, printer, interval_s
        self.record = getattr(ledger, "event", lambda kind, payload: None)  # never raises
        self.judge = Judge(stall_timeout_s)
        self.stall = None  # the stuck ranks the judge found (engine/liveness.Stall), once an attempt failed so
        # ranks whose per-step scalars make one step's set (a pipeline's first stage sends the data wait, its last
        # the loss): a step's set goes on once all have sent theirs, or at the end
        self.scalar_sources = scalar_sources
        self._partial: dict = {}  # step -> [values, sources so far]
        self.failure: Optional[BaseException] = None
        self.startup: Optional[dict] = None  # rank 0's first ``WorkerReporter.startup``
        self.checkpoints: list = []  # the checkpoints announced, in order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-mgpu-progress", daemon=True)

    def __enter__(self) -> "SinkPump":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pump()  # the last epoch's line
        for step in sorted(self._partial):  # a set a rank never completed (it failed): what arrived
            if self.failure is None:
                self._call(self.printer.scalars, step, self._partial.pop(step)[0])

    def wait_for_checkpoint(self, path: str, timeout_s: float = 30.0) -> bool:
        """After the pump stopped: drain until ``path``'s announcement is delivered (it comes from Ray Train's
        controller, a process whose sends are not ordered with the run's end), or a callback failed; False
        after ``timeout_s`` (the checkpoint is registered either way: only its ``on_checkpoint`` is missing)."""
        deadline = time.monotonic() + timeout_s
        while path not in self.checkpoints and self.failure is None:
            if time.monotonic() > deadline:
                logger.warning("checkpoint %s registered but not announced after %.0f s", path, timeout_s)
                return False
            time.sleep(0.02)
            self._pump()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._pump()

    def _pump(self) -> None:
        if self.failure is not None:
            return
        try:
            events = ray.get(self.sink.drain.remote(), timeout=10)
        except Exception:  # progress must never break training
            return
        for kind, payload in events:
            self.record(kind, payload)
            try:
                if kind == "scalars":
                    self._scalars(*payload)
                elif kind == "startup":
                    self.startup = self.startup or payload
                elif kind == "beat":
                    self._beat(payload)
                else:
                    if kind == "checkpoint":
                        self.checkpoints.append(payload)
                    deliver(kind, payload, self.printer)
            except Exception as exc:  # a callback or logger raised: the run fails with it, never silently
                self.failure = exc
                return
        self._judge()

    def _beat(self, payload: dict) -> None:
        self.judge.add(Beat(**payload), time.monotonic())

    def _judge(self) -> None:
        """A rank that stopped making progress: named on the driver, its process ended (the attempt fails)."""
        stall = self.judge.stall(time.monotonic())
        if stall is None:
            return
        self.stall = stall
        logger.warning("%s\n%s", stall.line, stall.report)
        self._call(self.printer.banner, f"raytrain-mgpu: {stall.line}")
        fail_stuck(stall)

    def _scalars(self, step: int, values: dict) -> None:
        # Only a step window's scalars (``train/*``, engine/step_scalars.StepWindow) come in parts; rank 0's
        # others (a pipeline's stage figures at an epoch's end) are whole: counted as a part, they would be held
        # to the run's end and could complete a step's set in place of the stage it still waits for.
        if self.scalar_sources == 1 or not all(name.startswith(WINDOW_PREFIX) for name in values):
            self.printer.scalars(step, values)
            return
        entry = self._partial.setdefault(step, [{}, 0])
        entry[0].update(values)
        entry[1] += 1
        if entry[1] >= self.scalar_sources:
            del self._partial[step]
            self.printer.scalars(step, entry[0])

    def _call(self, method, *args) -> None:
        try:
            method(*args)
        except Exception as exc:
            self.failure = exc
