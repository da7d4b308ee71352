"""model.py -> Task: load the user's file, check the protocol with clear errors, move batches to a device."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import random
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from autoprec import devices
from autoprec.errors import UserError, describe
from autoprec.policy import weights_digest
from autoprec.tensors import map_tensors
from autoprec.tune._core._config import SHAPE_BATCHES

REQUIRED = ("build_model", "batches", "loss_fn")
OPTIONAL = ("evaluate", "optimizer", "parallelize")
SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class Task:
    """The functions a model.py defines (or api.task_from_objects gives); `evaluate` and `optimizer` may be None.
    `path` names the task in error messages."""

    path: Path
    build_model: Callable[[], torch.nn.Module]
    batches: Callable[[str], Iterable]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    evaluate: Callable[[torch.nn.Module], float] | None = None
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None
    # parallelize(model, mesh): shards the built model (FSDP2's fully_shard per block) for a search under torchrun
    # (_ranks.py); a policy is applied before it, to the user's unsharded module names
    parallelize: Callable[[torch.nn.Module, Any], torch.nn.Module | None] | None = None
    label: str | None = None  # the name of a task built in Python (api.task_from_objects), which has no file

    @property
    def name(self) -> str:
        """The given label, else the file's stem, or its folder's name for the conventional `model.py`."""
        if self.label:
            return self.label
        stem = self.path.stem
        folder = self.path.resolve().parent.name
        return folder if stem == "model" and folder else stem


class Sharding(Protocol):
    """How a workload's candidates run when the model trains sharded over the ranks of one torchrun job
    (_ranks.Ranks): every rank builds, steps and evaluates each candidate together, led by rank 0."""

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """A candidate's model (the policy applied) sharded as the user trains it (model.py's parallelize)."""
        ...

    def trainer(self, workload: Workload, policy: Any, *, order: Any = None, compiled: bool = False) -> Any:
        """The leader's handle on one candidate's Trainer, built on every rank."""
        ...

    def metric(self, workload: Workload, candidate: Any) -> float:
        """A candidate's metric (the reference weights, its policy applied), evaluated on every rank together."""
        ...

    def trained_metric(self, trainer: Any) -> float:
        """The metric of the model a `trainer` (this sharding's handle) has trained, evaluated on every rank together."""
        ...

    def layout(self) -> dict[str, Any]:
        """What the policy file records of the layout it was measured on."""
        ...

    def run(self, workload: Workload, search: Callable[[], Any]) -> Any:
        """`search()` on the leader (rank 0), its result returned; on the other ranks, their part of it, and None."""
        ...


@dataclasses.dataclass
class Workload:
    """A task made ready on one device: the fp32 reference model and the batches, already moved. `sharding`: None
    on one device; under torchrun, the ranks every candidate runs on together (_ranks.Ranks)."""

    task: Task
    device: torch.device
    model: torch.nn.Module
    train: list
    eval: list
    sharding: Sharding | None = dataclasses.field(default=None, repr=False, compare=False)
    # the all-fp32 model's checked metric once taken (_metric.workload_fp32_metric, its one reader and writer)
    fp32_metric_seen: float | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @functools.cached_property
    def shape_batches(self) -> tuple[int, ...]:
        """The index of the first train batch of each distinct set of tensor shapes, in order (at most 1 +
        config.SHAPE_BATCHES): where the profile and a compiled candidate's warm-up meet every shape the training
        steps will."""
        first: dict[tuple, int] = {}
        for i, batch in enumerate(self.train):
            first.setdefault(batch_shapes(batch), i)
        return tuple(first.values())[: 1 + SHAPE_BATCHES]

    def profile_batches(self, batches: int) -> list:
        """The first `batches` train batches, then the first of each shape they do not show (shape_batches)."""
        return self.train[:batches] + [self.train[i] for i in self.shape_batches if i >= batches]

    @functools.cached_property
    def weights(self) -> str:
        """The reference model's weights digest (policy.weights_digest), taken once: the model is never trained in
        place (every candidate trains a copy)."""
        return weights_digest(self.model)


def batch_shapes(batch: object) -> tuple:
    """The shapes of a (nested) batch's tensors, in map_tensors order: what a compiled model specialises on."""
    shapes: list[tuple[int, ...]] = []

    def note(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    map_tensors(batch, note)
    return tuple(shapes)


def load_task(path: str | Path) -> Task:
    """Import a model.py and check that it defines the functions a search needs.

    The file is imported as a fresh module under a unique name (so torch.compile can trace its code), with its
    folder first on sys.path while it imports, so it can import its neighbours as `python model.py` would. Only
    the functions' presence is checked here; `prepare` then builds the model and checks the loss and the batches.
    Nothing is run but the file's top level.

    Args:
        path: The model.py file (a str or a Path). It must define `build_model()`, `batches(split)` and
            `loss_fn(model, batch)`, and may define `evaluate(model)` and `optimizer(model)` (README, "Your
            model: model.py").

    Returns:
        Task: the file's functions (`evaluate` and `optimizer` None where it does not define them), named after
        the file (its folder's name for a file called model.py). A SystemExit from any of them, later, is a
        UserError naming the file and the function.

    Raises:
        autoprec.UserError: The file does not exist or is not a Python file, importing it raised (its exception is
            named; a SystemExit at import too), a required function is missing, or one of the names is not a
            function.

    Example:
        >>> import autoprec.tune
        >>> task = autoprec.tune.load_task("examples/digits/model.py")  # doctest: +SKIP
        >>> workload = autoprec.tune.prepare(task, "cpu")  # doctest: +SKIP
        >>> task.name  # doctest: +SKIP
        'digits'
    """
    path = Path(path)
    if path.is_dir():
        inside = path / "model.py"
        fix = f"give its model.py: {inside}" if inside.is_file() else "give the path of the model.py inside it"
        raise UserError(f"{path}: a folder, not a model.py; {fix}")
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    module_name = f"_autoprec_model_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    # Registered under its unique name so torch.compile (dynamo), which imports a function's module to read
    # its globals, can trace the model's and loss's code.
    sys.modules[module_name] = module
    # Let the file import its own neighbours, as `python model.py` would.
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # SystemExit: a model.py that runs argparse or exit() at import
        sys.modules.pop(module_name, None)
        raise UserError(f"{path}: import failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if folder in sys.path:
            sys.path.remove(folder)

    def optional(name: str) -> Callable | None:
        fn = getattr(module, name, None)
        if fn is None:
            return None
        if not callable(fn):
            raise UserError(f"{path}: {name} must be a function, got {type(fn).__name__}")
        return guard_exit(path, name, fn)

    def required(name: str) -> Callable:
        fn = optional(name)
        if fn is None:
            raise UserError(f"{path}: missing required function {name}() (model.py must define {', '.join(REQUIRED)})")
        return fn

    # Checked in the order of REQUIRED + OPTIONAL (keyword arguments are evaluated left to right), so the first
    # problem reported is the same as a loop over them would find.
    return Task(
        path=path,
        build_model=required("build_model"),
        batches=required("batches"),
        loss_fn=required("loss_fn"),
        evaluate=optional("evaluate"),
        optimizer=optional("optimizer"),
        parallelize=optional("parallelize"),
    )


def guard_exit(where: str | Path, name: str, fn: Callable) -> Callable:
    """`fn` (one of the user's functions), with a SystemExit from inside it made a UserError: sys.exit() in a
    loss_fn or an evaluate (argparse's exit too) would otherwise end autoprec, wherever it calls it, with the
    model's exit code (0: success) and no result. Only SystemExit: KeyboardInterrupt and errors pass as they are."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            shown = "sys.exit()" if exc.code is None else f"sys.exit({exc.code!r})"
            raise UserError(
                f"{where}: {name}() called {shown} (SystemExit), which would end autoprec without a result; "
                "raise an exception instead, and keep exits under `if __name__ == '__main__':`"
            ) from None

    return call


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor inside a batch to `device`."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def _call(task: Task, what: str, fn: Callable, *args: Any, fix: str = "") -> Any:
    try:
        return fn(*args)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{task.path}: {what} raised {describe(exc)}{fix}") from exc


def meta_model(task: Task, *, verb: str) -> torch.nn.Module:
    """The model of `task` built under the meta device: its modules and shapes, no memory, no values, nothing trained
    or loaded where build_model() follows docs/model-file.md's meta rule. `verb` (predict, verify) names who needs
    it in the error. UserError naming the file where build_model() cannot run there or returns no module."""
    try:
        with torch.device("meta"):
            model = task.build_model()
    except Exception as exc:
        raise UserError(
            f"{task.path}: build_model() failed on the meta device ({describe(exc, 200)}); {verb} builds the model for "
            "its modules and shapes only: a build_model that loads or trains weights can return the bare model when "
            'torch.get_default_device().type == "meta" (docs/model-file.md)'
        ) from exc
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"{task.path}: build_model() must return a torch.nn.Module, got {type(model).__name__}")
    return model


def built(task: Task) -> torch.nn.Module:
    """The fp32 model build_model() gives, on the device it builds it on. UserError naming the file where it fails,
    returns no module, or gives weights that are not fp32 values."""
    model = _call(task, "build_model()", task.build_model)
    _check_weights(task, model)
    return model


def _load_split(task: Task, split: str, device: torch.device) -> list:
    data = _call(task, f"batches({split!r})", task.batches, split)
    if data is None or not isinstance(data, Iterable):
        raise UserError(f"{task.path}: batches({split!r}) must return an iterable of batches, got {type(data).__name__}")
    items = _call(task, f"iterating batches({split!r})", list, data)
    return [to_device(b, device) for b in items]


def _check_weights(task: Task, model: object) -> None:
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"{task.path}: build_model() must return a torch.nn.Module, got {type(model).__name__}")
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_meta:  # no values to copy to the device, evaluate or train
            raise UserError(
                f"{task.path}: build_model() gives a model on the meta device ({name} has no values); build it on "
                "the CPU, or call model.to_empty(device='cpu') and load_state_dict(...) before returning it"
            )
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise UserError(f"{task.path}: build_model() must give fp32 weights, but {name} is {p.dtype}")


def check_loss(task: Task, loss: object) -> torch.Tensor:
    """The loss as a tensor, or a UserError when it is not a real floating-point scalar."""
    if not isinstance(loss, torch.Tensor):
        raise UserError(f"{task.path}: loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.dim() != 0:
        raise UserError(f"{task.path}: loss_fn must return a scalar tensor, got shape {tuple(loss.shape)}")
    if not loss.is_floating_point():  # integers and bools have no gradient; a complex loss is not minimised
        fix = (
            "return its .real or .abs()"
            if loss.is_complex()
            else "compute it with a differentiable function (F.cross_entropy), not argmax or =="
        )
        raise UserError(f"{task.path}: loss_fn(model, batch) must return a real floating-point loss, got {loss.dtype}; {fix}")
    return loss


_OPTIMIZER_FIX = (
    "; optimizer(model) must return a torch.optim.Optimizer over model.parameters(), e.g. torch.optim.AdamW(model.parameters())"
)


def _check_optimizer(task: Task, model: torch.nn.Module) -> None:
    """optimizer(model) on the reference model, as training steps will call it on each candidate's copy."""
    if task.optimizer is None:
        return
    optimizer = _call(task, "optimizer(model)", task.optimizer, model, fix=_OPTIMIZER_FIX)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"{task.path}: optimizer(model) must return a torch.optim.Optimizer, got {type(optimizer).__name__}; "
            "return e.g. torch.optim.AdamW(model.parameters())"
        )
    given = {id(p) for p in model.parameters()}
    if not any(id(p) in given for group in optimizer.param_groups for p in group["params"]):
        raise UserError(
            f"{task.path}: optimizer(model) optimizes none of the parameters of the model it is given; build it "
            "from that model: torch.optim.AdamW(model.parameters())"
        )


def prepare(task: Task, device: str | torch.device) -> Workload:
    """Build the fp32 model on `device`, load both splits, and check the loss on the first train batch and the
    optimizer: a mistake there is found now, before anything is profiled."""
    device = torch.device(device)
    model = built(task).to(device)
    train = _load_split(task, "train", device)
    if not train:
        raise UserError(f"{task.path}: batches('train') yields no batches")
    evals = _load_split(task, "eval", device)
    if not evals and task.evaluate is None:
        raise UserError(f"{task.path}: batches('eval') yields no batches (needed by the default evaluate)")
    # The check must leave the model as built: a train-mode pass updates BatchNorm's running statistics (the fp32
    # metric, from which the budget is measured, moved by it) and draws from the random generators (dropout).
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    with devices.lookup(device).fork_rng(device), torch.enable_grad():
        loss = check_loss(task, _call(task, "loss_fn(model, batch)", task.loss_fn, model, train[0]))
    with torch.no_grad():
        for buffer, before in buffers:
            buffer.copy_(before)
    if not math.isfinite(loss.item()):
        raise UserError(f"{task.path}: loss_fn gives {loss.item()} for the fp32 model on the first train batch")
    if not loss.requires_grad:
        raise UserError(
            f"{task.path}: loss_fn(model, batch) gives a loss that does not require grad, so no training step can "
            "backpropagate it; compute it from the model's output without .detach(), .item() or torch.no_grad(), "
            "and leave the parameters requires_grad=True"
        )
    _check_optimizer(task, model)
    model.zero_grad(set_to_none=True)
    return Workload(task=task, device=device, model=model, train=train, eval=evals)


@contextlib.contextmanager
def random_state(workload: Workload, seed: int) -> Iterator[None]:
    """Seed torch's, Python's and (where imported) NumPy's global generators with `seed` for the block, and give
    the caller back the states it had: the determinism check draws from two states without moving the user's, and
    counting the matmuls (_coverage) leaves them where they were."""
    numpy = sys.modules.get("numpy")
    saved_python = random.getstate()
    saved_numpy = numpy.random.get_state() if numpy is not None else None
    try:
        device = devices.lookup(workload.device)
        with device.fork_rng(workload.device):
            device.manual_seed(workload.device, seed)
            random.seed(seed)
            if numpy is not None:
                numpy.random.seed(seed)
            yield
    finally:
        random.setstate(saved_python)
        if numpy is not None:
            numpy.random.set_state(saved_numpy)
