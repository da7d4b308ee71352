"""The tuner from Python: search (or sweep) a model you hold in a notebook or a script, no model.py needed.

    result = autoprec.tune.search(model, loss_fn, train_batches, eval_batches, budget="1%", out="results/net")
    policy = result.policy          # an autoprec.Policy; result.summary() is the table the CLI prints

The command line and these functions are one code path: both hand the budget over as the user gave it to
`search_and_report` / `sweep_and_report`, which write the same files; the pipeline resolves a relative one against
the fp32 metric its profile measures.
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from autoprec.files import write_text
from autoprec.formats import default_device
from autoprec.tune._core._budget import DEFAULT, Budget, Budgets, parse_budget, parse_budget_list
from autoprec.tune._core._config import SearchConfig, search_config
from autoprec.tune._core._space import SearchSpace, load_space
from autoprec.tune._measure._task import Task, Workload, guard_exit, prepare
from autoprec.tune._report._results import SearchResult, SweepResult
from autoprec.tune._search import _pipeline as pipeline
from autoprec.tune._search import _sweeper as sweeper

T = TypeVar("T")

NOT_KEPT = "not kept (out=None: the study lived in a temporary folder, removed)"

__all__ = ["search", "sweep", "search_and_report", "sweep_and_report", "task_from_objects"]


def search_and_report(
    workload: Workload,
    space: SearchSpace,
    config: SearchConfig,
    out_dir: str | Path,
    *,
    command: str,
    announce: Callable[[Budgets], None] | None = None,
) -> SearchResult | None:
    """pipeline.search, then summary.md and the heat maps beside its files (what `autoprec search` writes). On a
    sharded workload (under torchrun), rank 0 searches and writes, and returns the result; the other ranks take their
    part in every measurement and return None (Workload.sharding.run)."""
    from autoprec.tune._report._plots import plot_all
    from autoprec.tune._report._results import search_markdown

    def run() -> SearchResult:
        result = pipeline.search(workload, space, config, Path(out_dir), announce=announce)
        write_text(Path(out_dir) / "summary.md", search_markdown(result, command))
        plot_all(result.profile, Path(out_dir), title=f"{workload.task.name} on {result.profile.device}")
        return result

    return _on_ranks(workload, run)


def sweep_and_report(
    workload: Workload,
    space: SearchSpace,
    budgets: str | float | Sequence[float | str | Budget],
    config: SearchConfig,
    out_dir: str | Path,
    *,
    command: str,
    announce: Callable[[Budgets], None] | None = None,
) -> SweepResult | None:
    """sweeper.sweep, then sweep.md, pareto.png and the heat maps beside its files (what `autoprec sweep` writes): the
    heat maps beside the profile it measured, or where the one it reused has none; a reused profile's are left as
    they are (a search's files). Sharded: as search_and_report."""
    from autoprec.tune._report._plots import PROFILE_FIGURE, plot_all, plot_pareto
    from autoprec.tune._report._results import sweep_markdown

    def run() -> SweepResult:
        out = Path(out_dir)
        result = sweeper.sweep(workload, space, budgets, config, out, announce=announce)
        title = f"{workload.task.name} on {result.profile.device}"
        plot_pareto(result, out / "pareto.png", title=title)
        saved = result.saved
        folder = saved.folder if saved is not None else out
        if saved is None or saved.measured or not (folder / PROFILE_FIGURE).is_file():
            plot_all(result.profile, folder, title=title)
        write_text(out / "sweep.md", sweep_markdown(result, command))
        return result

    return _on_ranks(workload, run)


def _on_ranks(workload: Workload, run: Callable[[], T]) -> T | None:
    """`run()` here, or on a sharded workload led by rank 0 with the other ranks taking their part (None there)."""
    return run() if workload.sharding is None else workload.sharding.run(workload, run)


def task_from_objects(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    train_batches: Iterable,
    eval_batches: Iterable = (),
    *,
    evaluate: Callable[[torch.nn.Module], float] | None = None,
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
    name: str | None = None,
    parallelize: Callable[[torch.nn.Module, Any], torch.nn.Module | None] | None = None,
) -> Task:
    """A Task from objects in memory, checked as a model.py is. The search works on a copy of `model`: the
    caller's model, its device and its weights are left as they were."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for what, fn in (("loss_fn", loss_fn), ("evaluate", evaluate), ("optimizer", optimizer), ("parallelize", parallelize)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{what} must be a function, got {type(fn).__name__}")
    splits = {"train": train_batches, "eval": eval_batches}
    label = name or type(model).__name__
    # A SystemExit inside them is a UserError, as from a model.py: it would end the caller's script with no result
    hooks = (("loss_fn", loss_fn), ("evaluate", evaluate), ("optimizer", optimizer), ("parallelize", parallelize))
    guarded = {what: guard_exit(label, what, fn) for what, fn in hooks if fn is not None}
    return Task(
        path=Path(label),
        build_model=lambda: copy.deepcopy(model),
        batches=lambda split: splits[split],
        loss_fn=guarded["loss_fn"],
        evaluate=guarded.get("evaluate"),
        optimizer=guarded.get("optimizer"),
        parallelize=guarded.get("parallelize"),
        label=label,
    )


def _setup(
    model,
    loss_fn,
    train_batches,
    eval_batches,
    *,
    evaluate,
    optimizer,
    name,
    device,
    space,
    exclude,
    trials,
    seed,
    compile,
    progress,
    parallelize,
    config: Mapping[str, Any],
) -> tuple[Workload, SearchSpace, SearchConfig]:
    """The workload (a copy of the model, its batches on the device; with `parallelize`, sharded over the ranks of
    the caller's torch.distributed job: _ranks.Ranks), the space, and the settings (a search's budget among them, as
    the user gave it); compiled by default on CUDA, as the command line."""
    the_space = space if isinstance(space, SearchSpace) else load_space(space)
    task = task_from_objects(
        model, loss_fn, train_batches, eval_batches, evaluate=evaluate, optimizer=optimizer, name=name, parallelize=parallelize
    )
    workload = prepare(task, torch.device(device) if device is not None else default_device())
    if task.parallelize is not None:
        from autoprec.tune._measure._ranks import sharded  # noqa: PLC0415 (torch.distributed: a sharded search's alone)

        workload = sharded(workload)
    the_space = the_space.with_excludes(tuple(exclude), workload.model)
    settings = search_config(device=workload.device, compile=compile, trials=trials, seed=seed, progress=progress, **config)
    return workload, the_space, settings


def search(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    train_batches: Iterable,
    eval_batches: Iterable = (),
    *,
    evaluate: Callable[[torch.nn.Module], float] | None = None,
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
    budget: float | str | Budget = DEFAULT,
    trials: int | None = None,
    device: str | torch.device | None = None,
    out: str | Path | None = None,
    space: SearchSpace | str | Path | None = None,
    exclude: Sequence[str] = (),
    seed: int = 0,
    compile: bool | None = None,
    progress: bool = True,
    name: str | None = None,
    parallelize: Callable[[torch.nn.Module, Any], torch.nn.Module | None] | None = None,
    **config: Any,
) -> SearchResult | None:
    """Search per-layer formats for a model in memory, within a metric budget, and return the measured result.

    Runs the command line's own code path (`autoprec search model.py`) on objects instead of a model.py: the same
    checks on the functions (a mistake in them is one UserError before anything is profiled), the same profile,
    Optuna study and final re-measure, and, with `out`, the same files, so a rerun with the same `out` and settings
    resumes the study. The search works on a deep copy of `model`: the caller's model, its device and its weights
    are left as they were. The chosen policy's speedup and metric drop were measured on `device` in the final
    re-measure, beside the alternatives (uniform bf16, fp8 everywhere, ...), never predicted; its drop is within
    `budget`, and where no candidate stayed within it the policy is all-fp32.

    Args:
        model: The fp32 model (a torch.nn.Module; pretrained weights allowed). Copied, never changed.
        loss_fn: `loss_fn(model, batch)` returns the scalar training loss of one batch; it must require grad.
        train_batches: The training batches (an iterable, read once and kept on `device`): the profile, the
            trials' step times and train mode's steps use them.
        eval_batches: The batches the default metric, -(mean loss), is taken over. Default (): none, which needs
            `evaluate`.
        evaluate: `evaluate(model)` returns the metric, higher is better, deterministic (it is evaluated twice on
            the fp32 model and must agree). Default None: -(mean `loss_fn` over `eval_batches`).
        optimizer: `optimizer(model)` returns the optimizer for training steps (train mode, memory). Default None:
            AdamW.
        budget: The largest allowed metric drop from fp32: a number in the metric's units (0.01, "0.01"), a
            percentage of |fp32 metric| ("1%", the default), or a Budget. Must be finite and >= 0.
        trials: The most trials the study holds (a rerun resumes up to it; the search may stop sooner once no
            untried policy can win). Default None: the search space's `trials`.
        device: Where to profile and time, e.g. "cuda", "cuda:1", "cpu". Default None: cuda when available, else
            cpu.
        out: A folder for the files `autoprec search` writes (policy.json, summary.md, profile.csv, trials.csv, the
            heat maps, and the study that a rerun resumes). Default None: a temporary folder, removed at the end
            (the result's `storage` then says so).
        space: A SearchSpace, or the path of a search-space YAML file. Default None: the shipped default.yaml.
        exclude: fnmatch patterns of module names kept out of the search, as --exclude (e.g. "lm_head",
            "*.pooler"). Default (): none.
        seed: The Optuna sampler's seed, an integer from 0 to 2**32 - 1 (part of the study's identity). Default 0.
        compile: Time steps under torch.compile, as users who compile train. Default None: True on CUDA, False
            elsewhere (the metric is evaluated eagerly either way).
        progress: Show progress bars. Default True.
        name: The task's name in the output and the study's name. Default None: the model's class name.
        parallelize: `parallelize(model, mesh)` shards a candidate's model (its policy applied) over a device mesh
            of every rank, in place or returning it (FSDP2's fully_shard per block): a search of a model that trains
            sharded, called on every rank of an initialised torch.distributed job (torchrun), rank 0 leading
            (docs/sharded.md). Default None: one device.
        **config: Further SearchConfig fields, e.g. mode="train", train_steps=50, finalists=3,
            storage="sqlite:///study.db", objective="memory", predict_speed=False, time_budget=600.0 (seconds), and
            max_memory="40GB" (a size as --max-memory takes it, a share of the device's memory such as 0.8 or
            "80%", or a number of bytes).

    Returns:
        SearchResult | None: None on a rank other than 0 of a sharded search (rank 0 returns the result).
        `.policy` (the chosen autoprec.Policy, to apply with autoprec.apply_policy),
        `.summary()` (the table the command line prints), `.finals` (records.Finals: every re-measured candidate,
        the alternatives among them), `.trials` (trials.csv's rows, a pandas DataFrame) and `.profile`.

    Raises:
        autoprec.UserError: A mistake in the model or its functions, found before or while profiling (loss_fn
            fails or gives a non-finite loss, no train batches, a metric that moves between two evaluations, no
            layer the space tunes, a space file that cannot be read).
        TypeError: `model` is not a torch.nn.Module, a function argument is not callable, or `**config` names a
            field SearchConfig does not have.
        ValueError: A budget or setting out of range (a negative budget, seed, trials < 1, an unknown objective or
            mode, train_steps in weights mode), or an `exclude` pattern that matches no module.

    Example:
        >>> import torch
        >>> import autoprec
        >>> import autoprec.tune
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        >>> batches = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(4)]
        >>> def loss_fn(model, batch):
        ...     x, y = batch
        ...     return torch.nn.functional.cross_entropy(model(x), y)
        >>> result = autoprec.tune.search(model, loss_fn, batches, batches, budget="1%", out="results/net")  # doctest: +SKIP
        >>> print(result.summary())  # doctest: +SKIP
        >>> model = autoprec.apply_policy(model, result.policy)  # doctest: +SKIP
    """
    spec = parse_budget(budget)
    workload, the_space, settings = _setup(
        model,
        loss_fn,
        train_batches,
        eval_batches,
        evaluate=evaluate,
        optimizer=optimizer,
        name=name,
        device=device,
        space=space,
        exclude=exclude,
        trials=trials,
        seed=seed,
        compile=compile,
        progress=progress,
        parallelize=parallelize,
        config={**config, "budget": spec},
    )
    command = f"autoprec.tune.search({workload.task.name}, budget={str(spec)!r}, seed={seed})"
    if out is not None:
        return search_and_report(workload, the_space, settings, out, command=command)

    def in_a_temporary_folder() -> SearchResult:
        with tempfile.TemporaryDirectory(prefix="autoprec-") as folder:
            result = pipeline.search(workload, the_space, settings, folder)
        return dataclasses.replace(result, storage=NOT_KEPT)

    return _on_ranks(workload, in_a_temporary_folder)


def sweep(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    train_batches: Iterable,
    eval_batches: Iterable = (),
    *,
    budgets: str | float | Sequence[float | str | Budget] | None = None,
    evaluate: Callable[[torch.nn.Module], float] | None = None,
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
    trials: int | None = None,
    device: str | torch.device | None = None,
    out: str | Path | None = None,
    space: SearchSpace | str | Path | None = None,
    exclude: Sequence[str] = (),
    seed: int = 0,
    compile: bool | None = None,
    progress: bool = True,
    name: str | None = None,
    parallelize: Callable[[torch.nn.Module, Any], torch.nn.Module | None] | None = None,
    **config: Any,
) -> SweepResult | None:
    """Search once for several budgets: one two-objective study, then a verified policy per budget.

    The sweep's study optimises the goal (speed by default) and the metric drop together, so one set of trials
    serves every budget; each budget's policy is chosen from the trials within it and re-measured, as `search`
    chooses one (`autoprec sweep`'s code path, docs/sweep.md). The model is copied, never changed. With `out`,
    it writes one policy file per budget, sweep.md and pareto.png, and a rerun resumes the study.

    Args:
        model: The fp32 model (a torch.nn.Module). Copied, never changed.
        loss_fn: `loss_fn(model, batch)` returns the scalar training loss of one batch.
        train_batches: The training batches, as `search` takes them.
        eval_batches: The batches the default metric is taken over. Default (): none, which needs `evaluate`.
        budgets: Required. The budgets, each as `search`'s `budget` takes it: "0,0.5%,1%" (commas), a list such as
            [0, 0.01, "1%"], or one number. Duplicates are dropped and they are sorted. Default None is refused.
        evaluate: `evaluate(model)` returns the metric, higher is better. Default None: -(mean eval loss).
        optimizer: `optimizer(model)` returns the optimizer for training steps. Default None: AdamW.
        trials: The most trials the study holds. Default None: the search space's `trials`.
        device: Where to profile and time. Default None: cuda when available, else cpu.
        out: A folder for the files `autoprec sweep` writes. Default None: a temporary folder, removed at the end.
        space: A SearchSpace or a search-space YAML file's path. Default None: the shipped default.yaml.
        exclude: fnmatch patterns of module names kept out of the search. Default (): none.
        seed: The Optuna sampler's seed, from 0 to 2**32 - 1. Default 0.
        compile: Time steps under torch.compile. Default None: True on CUDA, False elsewhere.
        progress: Show progress bars. Default True.
        name: The task's name. Default None: the model's class name (the study is named "<name>-sweep").
        parallelize: As `search` takes it: a sweep of a model that trains sharded, on every rank. Default None.
        **config: Further SearchConfig fields, as `search` takes them (mode, finalists, storage, objective, ...).

    Returns:
        SweepResult | None: None on a rank other than 0 of a sharded sweep. `.policies` maps each absolute budget to its autoprec.Policy, `.table` holds a
        BudgetRow per budget, `.front` the Pareto front of the trials, `.summary()` the table the command line
        prints.

    Raises:
        TypeError: `budgets` not given, or an argument of the wrong type, as `search`.
        ValueError: A budget that is not a number >= 0 or a percentage, an empty list, or another setting out of
            range, as `search`.
        autoprec.UserError: A mistake in the model or its functions, as `search`.

    Example:
        >>> import torch
        >>> import autoprec.tune
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        >>> batches = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(4)]
        >>> def loss_fn(model, batch):
        ...     x, y = batch
        ...     return torch.nn.functional.cross_entropy(model(x), y)
        >>> result = autoprec.tune.sweep(model, loss_fn, batches, batches, budgets="0,0.5%,1%")  # doctest: +SKIP
        >>> for budget, policy in result.policies.items():  # doctest: +SKIP
        ...     print(budget, dict(policy.layers))
    """
    if budgets is None:
        raise TypeError("sweep() needs budgets=, e.g. budgets='0,0.5%,1%' or budgets=[0, 0.01]")
    specs = parse_budget_list([budgets] if isinstance(budgets, (int, float)) else budgets)
    workload, the_space, base = _setup(
        model,
        loss_fn,
        train_batches,
        eval_batches,
        evaluate=evaluate,
        optimizer=optimizer,
        name=name,
        device=device,
        space=space,
        exclude=exclude,
        trials=trials,
        seed=seed,
        compile=compile,
        progress=progress,
        parallelize=parallelize,
        config=config,
    )
    settings = dataclasses.replace(base, study_name=base.study_name or f"{workload.task.name}-sweep")
    command = f"autoprec.tune.sweep({workload.task.name}, budgets={', '.join(map(str, specs))!r}, seed={seed})"
    if out is not None:
        return sweep_and_report(workload, the_space, specs, settings, out, command=command)

    def in_a_temporary_folder() -> SweepResult:
        with tempfile.TemporaryDirectory(prefix="autoprec-") as folder:
            result = sweeper.sweep(workload, the_space, specs, settings, folder)
        return dataclasses.replace(result, storage=NOT_KEPT)

    return _on_ranks(workload, in_a_temporary_folder)
