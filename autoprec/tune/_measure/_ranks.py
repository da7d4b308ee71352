"""A search of a model that trains sharded: the ranks of one torchrun job measure every candidate together.

Rank 0 leads: it runs the whole search (the profile, the Optuna study, the output folder, every choice) as on one
device. The other ranks follow (`Ranks.follow`): they hold no study and write nothing, and do what the leader tells
them, one operation at a time, on their shard of the same candidate. The leader's Trainers are handles
(`RankedTrainer`) whose every step, timing and evaluation is sent to the followers before it runs on the leader, so
every rank builds the same candidate (the policy applied to the user's unsharded model, then model.py's
`parallelize(model, mesh)`), takes the same steps and times the same blocks: the ranks never disagree on a trial's
policy, because only the leader ever decides one.

What each rank measures is agreed after each operation: a block's time is the slowest rank's (the step is as slow
as it), a metric is the mean over ranks, a loss finite only where it is finite on every rank, a peak the largest.
An operation that fails on any rank fails on every rank, the failing rank named: the leader then treats it as it
treats a candidate's own failure on one device (the trial is infeasible) or, for a user's mistake, ends the run,
and tells the followers so (`Ranks.lead`). The per-layer numerics and layer timing of the profile run on the
leader's unsharded model alone (a layer's GEMMs under FSDP are the unsharded layer's on the rank's own batch).

Messages go over a gloo group of their own (CPU objects: no GPU synchronisation), whose timeout bounds every wait,
the followers' wait while the leader profiles alone included; a rank that dies ends the job through torchrun.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import itertools
import logging
import math
import statistics
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from autoprec import devices
from autoprec.devices import BlockTime
from autoprec.errors import RankFailed, UserError, describe
from autoprec.tensors import hash_tensor, map_tensors
from autoprec.tune._core._records import Candidate, as_candidate
from autoprec.tune._measure._metric import metric_of
from autoprec.tune._measure._task import Workload
from autoprec.tune._measure._trainer import Trainer, compile_scope, matmul_precision, trained_model

log = logging.getLogger("autoprec")

T = TypeVar("T")

# How long a rank waits for the others at any one message before it gives up, naming the wait: the followers wait
# this long for the leader's profile too, which runs on rank 0 alone (Ranks' timeout_s; the CLI's --rank-timeout)
DEFAULT_TIMEOUT_S = 3600.0


@dataclasses.dataclass(frozen=True)
class Layout:
    """The layout a sharded search measured on, recorded in its policy file (`measured.layout`): how many ranks,
    the device mesh's shape, and the function that sharded the model."""

    world_size: int
    mesh: tuple[int, ...]
    parallelize: str

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "mesh": list(self.mesh), "parallelize": self.parallelize}


def torchrun_ranks(environ: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(rank, world size, local rank) where `environ` is a torchrun worker's with more than one rank; else None."""
    try:
        world = int(environ.get("WORLD_SIZE", "1"))
        rank, local = int(environ.get("RANK", "0")), int(environ.get("LOCAL_RANK", "0"))
    except ValueError:
        raise UserError(
            f"WORLD_SIZE={environ.get('WORLD_SIZE')!r}, RANK={environ.get('RANK')!r}, LOCAL_RANK="
            f"{environ.get('LOCAL_RANK')!r}: torchrun sets these as whole numbers; run under torchrun, or unset them"
        ) from None
    return (rank, world, local) if world > 1 else None


class Ranks:
    """The ranks of one job searching together (Workload.sharding). Built on every rank, in the same order (it makes a
    device mesh and a message group: collective calls), after torch.distributed's default group is initialised (the
    command line does that; a script calling autoprec.tune.search under torchrun does it itself, as it would to train).
    `parallelize(model, mesh)`: model.py's, which shards a candidate's model in place or returns the sharded one;
    `where`: its name for the policy file."""

    def __init__(
        self,
        device: torch.device,
        parallelize: Callable[[torch.nn.Module, Any], torch.nn.Module | None],
        *,
        where: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        import torch.distributed as dist  # noqa: PLC0415 (only a sharded search needs it)
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

        if not dist.is_available() or not dist.is_initialized():
            raise UserError(
                "a sharded search runs inside an initialised torch.distributed job: run it under torchrun "
                "(torchrun --nproc_per_node N -m autoprec search model.py), or call "
                "torch.distributed.init_process_group() first"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, but got {timeout_s!r}")
        self._dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        self.mesh = init_device_mesh(device.type, (self.world,))
        # messages are Python objects: over gloo, on the CPU, so sending one never synchronises a GPU
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._parallelize, self._where = parallelize, where
        self._trainers: dict[int, Trainer] = {}
        self._keys = itertools.count()
        self._released: list[int] = []  # handles the leader dropped: their Trainers go on every rank with the next message
        self.workload: Workload | None = None  # this rank's, while it leads or follows: what operations run on
        self._broken = False  # a wait failed: the group cannot carry another message
        self._compiling: contextlib.ExitStack | None = None  # a follower's room for compiled candidates, once needed

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ Workload.sharding

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        # a failure is the candidate's, as a format's in the user's loss_fn is on one device (the all-fp32 model's is
        # the user's mistake, said as such where the fp32 metric and step are checked)
        sharded = self._parallelize(model, self.mesh)
        if sharded is not None and not isinstance(sharded, torch.nn.Module):
            raise UserError(
                f"{self._where}(model, mesh) returned {type(sharded).__name__}; return the sharded module, or None "
                "where it shards the model in place (fully_shard does)"
            )
        return model if sharded is None else sharded

    def trainer(
        self, workload: Workload, policy: Any, *, order: Sequence[int] | None = None, compiled: bool = False
    ) -> RankedTrainer:
        key = next(self._keys)
        try:
            self.together("trainer", key, as_candidate(policy), None if order is None else tuple(order), compiled)
        except BaseException:
            self.release(key)  # built on the ranks where it could be: dropped there with the next message
            raise
        return RankedTrainer(self, key)

    def metric(self, workload: Workload, candidate: Any) -> float:
        return float(self.together("metric", as_candidate(candidate)))

    def trained_metric(self, trainer: Any) -> float:
        if not isinstance(trainer, RankedTrainer) or trainer.ranks is not self:
            raise TypeError(f"a sharded search's trainer is a handle of its own ranks, not {type(trainer).__name__}")
        return float(self.together("trained_metric", trainer.key))

    def layout(self) -> dict[str, Any]:
        return Layout(world_size=self.world, mesh=tuple(self.mesh.shape), parallelize=self._where).to_dict()

    # ------------------------------------------------------------------ leading and following

    def run(self, workload: Workload, search: Callable[[], T]) -> T | None:
        try:
            self._check_same(workload)
            result = None
            if self.leader:
                result = self.lead(workload, search)
            else:
                self.follow(workload)
            if not self._broken:  # every rank done with the message group before any destroys it
                self._dist.barrier(group=self._group)
            return result
        finally:
            if not self._broken:  # the message group is this search's: a script may search again in its job
                self._dist.destroy_process_group(self._group)

    def _check_same(self, workload: Workload) -> None:
        """Every rank's reference weights and batches the same, so that the ranks take the same steps (a batch's
        shapes decide a compiled step's warm-up and the batch peak memory is measured on) and rank 0's profile, on
        its own data, measures what the ranks' mean metric does: else one line naming the rank and what differs."""
        mine = {"weights": workload.weights, "batches": f"{_digest(workload.train)} {_digest(workload.eval)}"}
        for rank, theirs in enumerate(self._gather(mine)):
            differs = [what for what in mine if theirs[what] != mine[what]]
            if differs:
                raise UserError(
                    f"{workload.task.path}: rank {rank}'s {' and '.join(differs)} differ from rank {self.rank}'s; a "
                    "sharded search measures every rank on the same ones: build the same weights on every rank (seed "
                    "build_model) and give every rank the same batches (the search's sample, not a rank's shard)"
                )

    def lead(self, workload: Workload, run: Callable[[], T]) -> T:
        """On the leader: `run()` (the search of `workload`, whose sharding this is), then tell the followers it is
        over, or how it failed."""
        if not self.leader:
            raise RuntimeError(f"rank {self.rank} follows (Ranks.follow); rank 0 leads")
        self.workload = workload
        try:
            result = run()
        except BaseException as exc:
            # a RankFailed every rank raised together, or a group that carries no message: nothing to tell them
            if not self._broken and not isinstance(exc, RankFailed):
                with contextlib.suppress(RankFailed):  # a follower gone already (Ctrl-C reaches every rank)
                    self._tell(("fail", isinstance(exc, UserError), _said(exc)))
            raise
        self._tell(("done",))
        return result

    def follow(self, workload: Workload) -> None:
        """On a follower: do what the leader sends, until it says the search is over. Raises where the leader's run
        failed, with its message (a UserError where it was the user's mistake)."""
        if self.leader:
            raise RuntimeError("rank 0 leads (Ranks.lead); the other ranks follow")
        self.workload = workload
        with contextlib.ExitStack() as self._compiling:
            while True:
                message = self._receive()
                if message[0] == "done":
                    return
                if message[0] == "fail":
                    _, users, text = message
                    said = f"rank 0 ended the search: {text}"
                    raise UserError(said) if users else RankFailed(said)
                _, op, args, released = message
                try:
                    self._do(op, args, released)
                except Exception:  # the leader decides what it ends (a trial, or the run) and says so
                    continue

    def compiling(self) -> None:
        """Before a follower builds its first compiled candidate: the leader empties its compile caches around each
        set of compiled candidates (compile_scope); a follower, told no such sets, keeps room for every candidate
        of a search instead, for the rest of it."""
        if self._compiling is not None and not self.leader:
            self._compiling.enter_context(compile_scope(True, 64))
            self._compiling = None  # entered: once

    def together(self, op: str, *args: Any) -> Any:
        """On the leader: `op` run on every rank at once (the followers told first), its results agreed (_OPS)."""
        if not self.leader:
            raise RuntimeError(f"rank {self.rank} follows: only rank 0 sends operations")
        released, self._released = self._released, []
        self._tell(("op", op, args, released))
        return self._do(op, args, released)

    def _do(self, op: str, args: tuple, released: Sequence[int]) -> Any:
        """`op` on this rank, its phases agreed with every rank's (_OPS: an operation is one phase, or a generator
        whose every `yield` is a point where the ranks agree before any collective of the next phase: a candidate
        that cannot be built on one rank fails on every rank there, before another rank waits in FSDP's all-gather
        for it). A failure on any rank raises on every rank (_failure); else the results, agreed."""
        for key in released:
            self._trainers.pop(key, None)
        run, agree = _OPS[op]
        phases: Any = None
        while True:
            value: Any = None
            error: BaseException | None = None
            done = True
            try:
                if self.workload is None:
                    raise RuntimeError("operations run while a rank leads (Ranks.lead) or follows (Ranks.follow)")
                if phases is None:
                    phases = run(self, self.workload, *args)
                    if not isinstance(phases, Generator):  # one phase: its value
                        value, phases = phases, ()
                        raise StopIteration(value)
                next(phases)
                done = False
            except StopIteration as stop:
                value = stop.value
            except Exception as exc:
                error = exc
                if not self.leader:  # said at once: the other ranks may be waiting on this one in a collective
                    log.warning("rank %d: %s failed here: %s", self.rank, op, _said(exc))
            except RankFailed:  # this group carries no more messages: nothing to agree
                _close(phases)
                raise
            said = None if error is None else _Failure.of(error)
            outcomes = self._gather((said, done, value if agree is not None and done and error is None else None))
            failed = [(rank, f) for rank, (f, _, _) in enumerate(outcomes) if f is not None]
            if failed:
                _close(phases)  # its `finally`s now, not whenever the collector finds it (a paused collector)
                raise _failure(failed, self.world, error)
            if done:
                return value if agree is None else agree([v for _, _, v in outcomes])

    def release(self, key: int) -> None:
        """A handle the leader no longer holds: its Trainer goes on every rank with the next message."""
        self._released.append(key)

    def _tell(self, message: tuple) -> None:
        box = [message]
        self._wait("rank 0's message", lambda: self._dist.broadcast_object_list(box, src=0, group=self._group))

    def _receive(self) -> tuple:
        box: list[Any] = [None]
        self._wait("rank 0's next operation", lambda: self._dist.broadcast_object_list(box, src=0, group=self._group))
        return tuple(box[0])

    def _gather(self, mine: object) -> list:
        out: list[Any] = [None] * self.world
        self._wait("every rank's result", lambda: self._dist.all_gather_object(out, mine, group=self._group))
        return out

    def _wait(self, what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except RuntimeError as exc:  # gloo's timeout, or a peer gone: the job cannot go on
            self._broken = True
            raise RankFailed(
                f"rank {self.rank} of {self.world}: no answer waiting for {what} within {self.timeout_s:g} s, or a rank "
                f"is gone ({describe(exc, limit=200)}); a rerun resumes the study"
            ) from exc


def agree_ready(mine: UserError | None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Every rank's outcome of loading and checking model.py, agreed before anything that waits for every rank (the
    mesh, the message group): a rank whose checks failed would never reach those, and the others would wait for it
    until the timeout, saying nothing of why. Raises on every rank where any failed: this rank's own error, or one
    naming the first rank that failed and its error."""
    import torch.distributed as dist  # noqa: PLC0415 (only a sharded search needs it)

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    said: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(said, None if mine is None else str(mine), group=group)
    except RuntimeError as exc:
        raise RankFailed(
            f"no answer from every rank after loading model.py within {timeout_s:g} s ({describe(exc, limit=200)})"
        ) from exc
    finally:
        dist.destroy_process_group(group)
    if mine is not None:
        raise mine
    failed = [(rank, text) for rank, text in enumerate(said) if text is not None]
    if failed:
        rank, text = failed[0]
        raise UserError(
            f"rank {rank} of {len(said)}: {text}" + (f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else "")
        )


def sharded(workload: Workload, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Workload:
    """`workload` measured on every rank of the caller's job together, sharded by its task's parallelize (which it
    must have), named in the policy file by the task's file (or a Python task's label)."""
    parallelize = workload.task.parallelize
    if parallelize is None:
        raise ValueError(f"{workload.task.path}: a sharded workload needs its task's parallelize(model, mesh)")
    where = f"{workload.task.path.name}:parallelize"
    return dataclasses.replace(workload, sharding=Ranks(workload.device, parallelize, where=where, timeout_s=timeout_s))


class RankedTrainer:
    """The leader's handle on one candidate's Trainer, built on every rank: it answers as a Trainer does, each call
    run on every rank together. Dropped, its Trainers go on every rank (with the next message: never from inside the
    collector, which may run between any two lines)."""

    def __init__(self, ranks: Ranks, key: int):
        self.ranks, self.key = ranks, key
        self._local = ranks._trainers[key]
        weakref.finalize(self, ranks.release, key)

    # what a Clock and the callers read: the leader's own (the same candidate on every rank)
    @property
    def model(self) -> torch.nn.Module:
        return self._local.model

    @property
    def policy(self) -> Any:
        return self._local.policy

    @property
    def tf32(self) -> bool:
        return self._local.tf32

    @property
    def compiled(self) -> bool:
        return self._local.compiled

    @property
    def first_step_s(self) -> float | None:
        return self._local.first_step_s

    @property
    def steps(self) -> int:
        return self._local.steps

    @property
    def workload(self) -> Workload:
        return self._local.workload

    def step(self, batch_index: int | None = None) -> torch.Tensor:
        return self.ranks.together("step", self.key, batch_index)  # type: ignore[no-any-return]

    def __call__(self) -> torch.Tensor:
        return self.step()

    def warm_shapes(self) -> None:
        self.ranks.together("warm_shapes", self.key)

    def time_on_ranks(self, calls: int, *, kernels: bool = False) -> BlockTime:
        """`calls` steps timed on every rank at once (DeviceClock): the slowest rank's block."""
        return self.ranks.together("time", self.key, calls, kernels)  # type: ignore[no-any-return]

    def peak_memory(self) -> int | None:
        return self.ranks.together("peak_memory", self.key)  # type: ignore[no-any-return]

    def state(self) -> Iterator[torch.Tensor]:
        return self._local.state()

    @property
    def finite(self) -> bool:
        return bool(self.ranks.together("finite", self.key))

    @property
    def skipped(self) -> int:
        return int(self.ranks.together("skipped", self.key))


@dataclasses.dataclass(frozen=True)
class _Failure:
    """One rank's failure as the others learn it: the user's mistake, the job's (a collective that broke: no
    operation can follow), or a candidate's (what cannot run in a format: a trial's end, as on one device)."""

    users: bool
    fatal: bool
    text: str

    @classmethod
    def of(cls, exc: BaseException) -> _Failure:
        import torch.distributed as dist  # noqa: PLC0415 (loaded already: a rank runs inside a job)

        return cls(isinstance(exc, UserError), isinstance(exc, (RankFailed, dist.DistError)), _said(exc))


class OnRankError(RuntimeError):
    """An operation failed on another rank, as a candidate fails on one device (a format its code cannot run): the
    trial ends, the search goes on. The message names the rank."""


def _failure(failed: Sequence[tuple[int, _Failure]], world: int, mine: BaseException | None) -> BaseException:
    """What every rank raises when an operation failed on some: the job's end where a collective broke anywhere
    (RankFailed, naming every failure, the ranks' own first: a rank that broke in user code leaves the others
    waiting in FSDP's collectives until the timeout); the user's mistake as one UserError; else this rank's own
    error as it was (a candidate's error reads as on one device), or one naming the rank it came from."""
    named = [f"rank {rank} of {world}: {f.text}" for rank, f in sorted(failed, key=lambda rf: rf[1].fatal)]
    if any(f.fatal for _, f in failed):
        return RankFailed("; ".join(named))
    users = [n for n, (_, f) in zip(named, sorted(failed, key=lambda rf: rf[1].fatal)) if f.users]
    if users:
        return UserError(users[0])
    return mine if mine is not None else OnRankError(named[0])


def _close(phases: Any) -> None:
    if isinstance(phases, Generator):
        phases.close()


def _digest(batches: Sequence[object]) -> str:
    """A short hash of every tensor of the batches, in order (shapes, dtypes and values), and of their count."""
    h = hashlib.sha256(f"{len(batches)} batches;".encode())

    def note(t: torch.Tensor) -> torch.Tensor:
        hash_tensor(h, t)
        return t

    for batch in batches:
        map_tensors(batch, note)
    return h.hexdigest()[:16]


def _said(exc: BaseException) -> str:
    """An error as another rank's message tells it: a user's mistake as its one line, anything else with its type."""
    return str(exc) if isinstance(exc, UserError) else describe(exc, limit=None)


# ---------------------------------------------------------------------- the operations, and how each is agreed


def _build(ranks: Ranks, workload: Workload, key: int, candidate: Candidate, order: Any, compiled: bool) -> None:
    if compiled:
        ranks.compiling()
    ranks._trainers[key] = Trainer(workload, candidate, order=order, compiled=compiled)


def _step(ranks: Ranks, workload: Workload, key: int, batch_index: int | None) -> torch.Tensor:
    return ranks._trainers[key].step(batch_index)


def _warm(ranks: Ranks, workload: Workload, key: int) -> None:
    ranks._trainers[key].warm_shapes()


def _time(ranks: Ranks, workload: Workload, key: int, calls: int, kernels: bool) -> Generator[None, None, BlockTime]:
    trainer = ranks._trainers[key]
    device = trainer.workload.device
    # no collection of earlier garbage from here to the block's end, on any rank (the leader's clock pauses its own:
    # interleaved_times); the agreement at the yield lines the ranks' clocks up (rank 0's would otherwise hold the
    # others' wait for its message)
    with devices.collector_paused():
        yield
        return devices.lookup(device).time_block(device, trainer, calls, kernels=kernels)


def _slowest(blocks: list[BlockTime]) -> BlockTime:
    hosts = [b.host_s for b in blocks if b.host_s is not None]
    helds = [b.held for b in blocks if b.held is not None]
    return BlockTime(
        max(b.seconds for b in blocks),
        host_s=max(hosts) if hosts else None,
        held=all(helds) if helds else None,
    )


def _peak(ranks: Ranks, workload: Workload, key: int) -> int | None:
    return ranks._trainers[key].peak_memory()


def _largest(peaks: list[int | None]) -> int | None:
    return None if any(p is None for p in peaks) else max(p for p in peaks if p is not None)


def _finite(ranks: Ranks, workload: Workload, key: int) -> bool:
    return ranks._trainers[key].finite


def _skipped(ranks: Ranks, workload: Workload, key: int) -> int:
    return ranks._trainers[key].skipped


def _trained_metric(ranks: Ranks, workload: Workload, key: int) -> float:
    trainer = ranks._trainers[key]
    with matmul_precision(trainer.workload.device, trainer.tf32):
        return metric_of(trainer.workload, trainer.model)


def _metric(ranks: Ranks, workload: Workload, candidate: Candidate) -> Generator[None, None, float]:
    model = trained_model(workload, candidate.policy)  # built and sharded on every rank before any collective
    yield
    with matmul_precision(workload.device, candidate.tf32):
        return metric_of(workload, model)


def _mean(values: list[float]) -> float:
    """The ranks' metrics, each of its own eval batches: their mean (NaN where any is)."""
    return math.nan if any(not math.isfinite(v) for v in values) else statistics.fmean(values)


# name -> (what each rank runs, how the ranks' results are agreed; None: each keeps its own, nothing is sent)
_OPS: dict[str, tuple[Callable[..., Any], Callable[[list], Any] | None]] = {
    "trainer": (_build, None),
    "step": (_step, None),
    "warm_shapes": (_warm, None),
    "time": (_time, _slowest),
    "peak_memory": (_peak, _largest),
    "finite": (_finite, all),
    "skipped": (_skipped, max),
    "trained_metric": (_trained_metric, _mean),
    "metric": (_metric, _mean),
}
