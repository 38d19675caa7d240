"""Pipeline schedules as data: per-rank orders of forward/backward actions.

A schedule is a pure function of ``(ranks, micro-batches)`` returning, for each rank, the
order in which it runs ``Action(stage, kind, microbatch)`` -- printed ``"1F0"`` for the
forward of micro-batch 0 on stage 1, as in ``torch.distributed.pipelining``. The runtime
(:mod:`raytrain_mgpu.pipeline.executor`) only executes these lists, so everything that
can go wrong with an order (a missing action, a deadlock, too many activations held)
is tested here without processes, Ray or a GPU.

Stages and ranks: with ``gpipe`` and ``1f1b`` rank r holds stage r. With
``interleaved_1f1b`` each rank holds ``CHUNKS_PER_RANK`` model chunks ("virtual
stages"), stage s living on rank ``s % ranks`` (Narayanan et al. 2021), which shrinks
the bubble by that factor at the cost of more messages.

Dependencies an order must respect: ``F(s, i)`` after ``F(s-1, i)``; ``B(s, i)`` after
``F(s, i)`` and after ``B(s+1, i)``. Sends are asynchronous in the runtime, so a rank
only ever waits for the input of its next action: :func:`simulate` models exactly that.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

FORWARD = "F"
BACKWARD = "B"
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
CHUNKS_PER_RANK = 2
"""Model chunks per rank for ``interleaved_1f1b``."""

__all__ = ["Action", "FORWARD", "BACKWARD", "SCHEDULES", "CHUNKS_PER_RANK", "ScheduleError", "Timeline",
           "gpipe", "one_f_one_b", "interleaved_one_f_one_b", "build_order", "num_virtual_stages",
           "stage_rank", "check_schedule", "ideal_bubble_fraction", "simulate", "format_grid",
           "channel_sequences", "forward_only"]


class Action(NamedTuple):
    """One unit of work: the forward or backward of one micro-batch on one stage."""

    stage: int
    kind: str  # FORWARD or BACKWARD
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    __repr__ = __str__


Order = List[List[Action]]
"""``order[rank]`` = the actions of that rank, in execution order."""


class ScheduleError(ValueError):
    """An order that cannot run: missing or repeated actions, or a deadlock."""


# ----------------------------------------------------------------------------- generators


def gpipe(num_ranks: int, num_microbatches: int) -> Order:
    """Fill-drain (Huang et al. 2019): all forwards, then all backwards.

    Holds the activations of every micro-batch at once; simplest, and the most memory.
    """
    return [[Action(rank, FORWARD, i) for i in range(num_microbatches)]
            + [Action(rank, BACKWARD, i) for i in range(num_microbatches)]
            for rank in range(num_ranks)]


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Order:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): same bubble as GPipe, bounded memory.

    Rank r keeps at most ``num_ranks - r`` micro-batches' activations alive instead of all.
    """
    order = []
    for rank in range(num_ranks):
        actions = []
        # warm-up: fill the pipeline, as many forwards as stages from here to the end
        warmup = min(num_microbatches, num_ranks - rank)
        actions += [Action(rank, FORWARD, i) for i in range(warmup)]
        # steady state: one backward frees an activation, one forward takes it again
        for i in range(num_microbatches - warmup):
            actions += [Action(rank, BACKWARD, i), Action(rank, FORWARD, warmup + i)]
        # cool-down: drain the remaining backwards
        actions += [Action(rank, BACKWARD, i) for i in range(num_microbatches - warmup, num_microbatches)]
        order.append(actions)
    return order


def interleaved_one_f_one_b(num_ranks: int, num_microbatches: int, chunks: int = CHUNKS_PER_RANK) -> Order:
    """Interleaved 1F1B (Megatron-LM): ``chunks`` virtual stages per rank, stage s on rank s % ranks.

    Micro-batches go through the chunks in groups of ``num_ranks``; needs
    ``num_microbatches % num_ranks == 0``.
    """
    group = num_ranks * chunks
    total = num_microbatches * chunks

    def unit(rank: int, k: int, kind: str) -> Action:
        chunk = (k // num_ranks) % chunks
        if kind == BACKWARD:
            chunk = chunks - 1 - chunk
        microbatch = (k // group) * num_ranks + k % num_ranks
        return Action(chunk * num_ranks + rank, kind, microbatch)

    order = []
    for rank in range(num_ranks):
        # warm-up: deeper on earlier ranks, plus one round per extra chunk
        warmup = min(total, (num_ranks - rank - 1) * 2 + (chunks - 1) * num_ranks)
        actions = [unit(rank, k, FORWARD) for k in range(warmup)]
        # steady state: one forward, one backward
        for k in range(total - warmup):
            actions += [unit(rank, warmup + k, FORWARD), unit(rank, k, BACKWARD)]
        # cool-down
        actions += [unit(rank, k, BACKWARD) for k in range(total - warmup, total)]
        order.append(actions)
    return order


def num_virtual_stages(schedule: str, num_ranks: int) -> int:
    """Model chunks the schedule needs: one per rank, or ``CHUNKS_PER_RANK`` per rank."""
    return num_ranks * CHUNKS_PER_RANK if schedule == "interleaved_1f1b" else num_ranks


def stage_rank(stage: int, num_ranks: int) -> int:
    return stage % num_ranks


def check_schedule(schedule: str, num_ranks: int, num_microbatches: int) -> None:
    """Raise ``ValueError`` (naming the fields and the fix) if the schedule cannot run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"TrainConfig.schedule={schedule!r} is not one of {list(SCHEDULES)}. "
                         f"Use schedule='1f1b'.")
    if schedule in ("1f1b", "interleaved_1f1b") and num_microbatches < num_ranks:
        raise ValueError(
            f"TrainConfig.num_microbatches={num_microbatches} is smaller than num_stages={num_ranks}: "
            f"schedule={schedule!r} needs at least one micro-batch per stage in flight. Set "
            f"num_microbatches >= {num_ranks} (4 x num_stages keeps the bubble under 20%), or use "
            f"schedule='gpipe'.")
    if schedule == "interleaved_1f1b" and num_microbatches % num_ranks:
        lower = num_microbatches // num_ranks * num_ranks
        raise ValueError(
            f"TrainConfig.num_microbatches={num_microbatches} is not a multiple of num_stages={num_ranks}: "
            f"schedule='interleaved_1f1b' sends micro-batches through the chunks in groups of num_stages. "
            f"Set num_microbatches to {max(lower, num_ranks)} or {lower + num_ranks}.")


def build_order(schedule: str, num_ranks: int, num_microbatches: int) -> Order:
    """The per-rank action order for a ``TrainConfig.schedule`` name."""
    check_schedule(schedule, num_ranks, num_microbatches)
    if schedule == "gpipe":
        return gpipe(num_ranks, num_microbatches)
    if schedule == "1f1b":
        return one_f_one_b(num_ranks, num_microbatches)
    return interleaved_one_f_one_b(num_ranks, num_microbatches)


def ideal_bubble_fraction(schedule: str, num_ranks: int, num_microbatches: int) -> float:
    """Idle share of a step with equal stage costs and free communication.

    ``(p-1) / (m+p-1)`` for GPipe and 1F1B; interleaving divides the fill time by the
    number of chunks: ``(p-1) / (v*m + p-1)``.
    """
    chunks = CHUNKS_PER_RANK if schedule == "interleaved_1f1b" else 1
    return (num_ranks - 1) / (chunks * num_microbatches + num_ranks - 1)


# ----------------------------------------------------------------------------- analysis


class Timeline(NamedTuple):
    """Result of :func:`simulate`."""

    starts: Dict[Action, int]  # start time of every action
    makespan: int
    max_in_flight: List[int]  # per rank: most micro-batches with forward done, backward not
    busy: List[int]  # per rank: time spent computing

    def bubble_fraction(self) -> float:
        return 1 - sum(self.busy) / (len(self.busy) * self.makespan)


def _check_complete(order: Order, num_stages: int, num_microbatches: int, kinds: Tuple[str, ...]) -> None:
    num_ranks = len(order)
    seen = {}
    for rank, actions in enumerate(order):
        for action in actions:
            if stage_rank(action.stage, num_ranks) != rank:
                raise ScheduleError(f"rank {rank} runs {action}, but stage {action.stage} lives on rank "
                                    f"{stage_rank(action.stage, num_ranks)}")
            if action in seen:
                raise ScheduleError(f"{action} appears twice (ranks {seen[action]} and {rank})")
            seen[action] = rank
    expected = {Action(s, k, i) for s in range(num_stages) for k in kinds
                for i in range(num_microbatches)}
    missing = sorted(expected - set(seen))
    extra = sorted(set(seen) - expected)
    if missing or extra:
        raise ScheduleError(f"order is incomplete: missing {missing[:8]}, unexpected {extra[:8]}")


def _ready(action: Action, done: Dict[Action, int], now: int, num_stages: int) -> bool:
    """Whether the inputs of ``action`` exist at time ``now``."""
    stage, kind, mb = action
    if kind == FORWARD:
        needs = [] if stage == 0 else [Action(stage - 1, FORWARD, mb)]
    else:
        needs = [Action(stage, FORWARD, mb)] + ([] if stage == num_stages - 1 else [Action(stage + 1, BACKWARD, mb)])
    return all(done.get(n, now + 1) <= now for n in needs)


def simulate(order: Order, num_stages: Optional[int] = None, forward_cost: int = 1,
             backward_cost: int = 1) -> Timeline:
    """Run ``order`` on an ideal machine: fixed costs, free and asynchronous communication.

    Raises :class:`ScheduleError` for an incomplete order or a deadlock (the message holds
    the grid up to the point where every rank waits).
    """
    num_ranks = len(order)
    num_stages = num_stages or num_ranks
    # forward-only orders (evaluation) are checked too
    kinds = (FORWARD, BACKWARD) if any(a.kind == BACKWARD for r in order for a in r) else (FORWARD,)
    num_microbatches = 1 + max((a.microbatch for r in order for a in r), default=-1)
    _check_complete(order, num_stages, num_microbatches, kinds)
    cost = {FORWARD: forward_cost, BACKWARD: backward_cost}
    position = [0] * num_ranks
    free_at = [0] * num_ranks
    done: Dict[Action, int] = {}
    starts: Dict[Action, int] = {}
    in_flight, max_in_flight, busy = [0] * num_ranks, [0] * num_ranks, [0] * num_ranks
    now = 0
    while len(done) < sum(len(a) for a in order):
        progressed = False
        for rank in range(num_ranks):
            if position[rank] >= len(order[rank]) or free_at[rank] > now:
                continue
            action = order[rank][position[rank]]
            if not _ready(action, done, now, num_stages):
                continue
            starts[action] = now
            done[action] = free_at[rank] = now + cost[action.kind]
            busy[rank] += cost[action.kind]
            in_flight[rank] += 1 if action.kind == FORWARD else -1
            max_in_flight[rank] = max(max_in_flight[rank], in_flight[rank])
            position[rank] += 1
            progressed = True
        pending = [t for t in list(done.values()) + free_at if t > now]
        if not progressed and not pending:
            stuck = [str(order[r][position[r]]) for r in range(num_ranks) if position[r] < len(order[r])]
            raise ScheduleError(f"deadlock at time {now}: every rank waits (next actions {stuck})\n"
                                + _grid(starts, num_ranks, now))
        now = min(pending) if pending else now
    return Timeline(starts, max(done.values()), max_in_flight, busy)


def _grid(starts: Dict[Action, int], num_ranks: int, makespan: int,
          mark: Optional[Action] = None) -> str:
    width = max([len(str(a)) for a in starts] + [6]) + 2
    rows = [[""] * num_ranks for _ in range(max(makespan, 1))]
    for action, start in starts.items():
        label = f">{action}<" if action == mark else str(action)
        rows[start][stage_rank(action.stage, num_ranks)] = label
    lines = ["step | " + " | ".join(f"rank {r}".ljust(width) for r in range(num_ranks))]
    for t, row in enumerate(rows):
        lines.append(f"{t:4d} | " + " | ".join((cell or ".").ljust(width) for cell in row))
    return "\n".join(lines)


def format_grid(order: Order, num_stages: Optional[int] = None, mark: Optional[Action] = None) -> str:
    """The step x rank grid of ``order`` (unit costs), ``mark`` shown as ``>1F3<``."""
    timeline = simulate(order, num_stages)
    return _grid(timeline.starts, len(order), timeline.makespan, mark)


def channel_sequences(order: Order, num_stages: Optional[int] = None) -> Dict[Tuple[str, int, int], Tuple[list, list]]:
    """For each one-way channel ``(kind, src_rank, dst_rank)``: (messages in send order, in receive order).

    The runtime posts receives in its own action order; a channel whose two sequences
    differ would pair messages wrongly on transports that match in order (NCCL).
    """
    num_ranks = len(order)
    num_stages = num_stages or num_ranks
    channels: Dict[Tuple[str, int, int], Tuple[list, list]] = {}
    for rank, actions in enumerate(order):
        for stage, kind, mb in actions:
            if kind == FORWARD and stage > 0:  # receives its input from stage - 1
                src = stage_rank(stage - 1, num_ranks)
                channels.setdefault((FORWARD, src, rank), ([], []))[1].append((stage, mb))
            if kind == FORWARD and stage < num_stages - 1:  # sends its output to stage + 1
                dst = stage_rank(stage + 1, num_ranks)
                channels.setdefault((FORWARD, rank, dst), ([], []))[0].append((stage + 1, mb))
            if kind == BACKWARD and stage < num_stages - 1:  # receives the output grad
                src = stage_rank(stage + 1, num_ranks)
                channels.setdefault((BACKWARD, src, rank), ([], []))[1].append((stage, mb))
            if kind == BACKWARD and stage > 0:  # sends the input grad
                dst = stage_rank(stage - 1, num_ranks)
                channels.setdefault((BACKWARD, rank, dst), ([], []))[0].append((stage - 1, mb))
    return channels


def forward_only(num_ranks: int, num_microbatches: int, num_stages: Optional[int] = None) -> Order:
    """Evaluation order: every forward, stage by stage on each rank (no activations kept)."""
    num_stages = num_stages or num_ranks
    order: Order = [[] for _ in range(num_ranks)]
    for stage in range(num_stages):
        order[stage_rank(stage, num_ranks)] += [Action(stage, FORWARD, i) for i in range(num_microbatches)]
    return order
