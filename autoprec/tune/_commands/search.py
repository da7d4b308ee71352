"""`autoprec search` and `autoprec sweep`: the study's options they share, the settings they build (as the Python API
builds them), and each verb."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable

import torch

from autoprec.errors import UserError
from autoprec.tune._api import search_and_report, sweep_and_report
from autoprec.tune._commands._shared import Verb, model_arguments, model_device, out_dir, prepare_model, print_json, say
from autoprec.tune._core._budget import DEFAULT, parse_budget_list
from autoprec.tune._core._config import SearchConfig, search_config
from autoprec.tune._core._goal import DEFAULT_GOAL, objective_help, objective_metavar
from autoprec.tune._core._numbers import parse_decimal, parse_integer
from autoprec.tune._core._space import SearchSpace
from autoprec.tune._core._targets import targets as planned_for
from autoprec.tune._search._storage import hide_credentials


def study_arguments(p: argparse.ArgumentParser, default_study: str) -> None:
    """The options of a study: search's and sweep's."""
    p.add_argument("--trials", type=parse_integer, help="trials in the study, counting earlier runs of it (default: the space's)")
    p.add_argument("--storage", help="Optuna storage URL or journal file (default: <out>/study.journal)")
    p.add_argument("--study", help=f"study name (default: {default_study}); the same name resumes")
    p.add_argument("--seed", type=parse_integer, default=0, help="sampler seed (default 0)")
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="rerunning a finished study keeps the result it wrote; this re-measures its finalists and chooses again",
    )
    p.add_argument(
        "--mode",
        default="weights",
        metavar="{weights,train}",
        help="what the budget applies to: the metric of the given weights with the policy (weights, "
        "default), or after --train-steps training steps against fp32 trained alike (train)",
    )
    p.add_argument("--train-steps", type=parse_integer, metavar="K", help="train mode: training steps per candidate (default 50)")
    p.add_argument(
        "--noise-runs",
        type=parse_integer,
        metavar="R",
        help="train mode: fp32 runs with seeds 0..R-1 whose spread is the noise floor (default 3)",
    )
    p.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="the most peak memory a training step may need: a size (40GB, 512MiB) or a share of the "
        "device's memory (0.8, 80%%); candidates above it are infeasible",
    )
    p.add_argument(
        "--numerics",
        choices=("offered", "all"),
        default="offered",
        help="the profile's numerics (SQNR, overflow, metric drop) for the formats the timing keeps in "
        "play (offered, default: minutes saved) or for every format the device can run (all), "
        "as `autoprec profile` measures them",
    )
    # every registered goal (autoprec.tune._core._goal's registry); SearchConfig refuses another name, listing them
    p.add_argument("--objective", default=DEFAULT_GOAL, metavar=objective_metavar(), help=objective_help())
    p.add_argument(
        "--target",
        metavar="{" + ",".join(t.name for t in planned_for()) + "}",
        help="with --objective flops: the device to plan for, whose step time the step-time predictor "
        "predicts from its datasheet's rates and bandwidth (a prediction, not a measurement: docs/planning.md)",
    )
    p.add_argument(
        "--run-steps",
        type=parse_integer,
        metavar="N",
        help="the training run the search tunes, in steps: the summary says the search's own time as a share of "
        "it (the goal: at most 2%%)",
    )
    p.add_argument(
        "--rank-timeout",
        type=parse_decimal,
        default=60.0,
        metavar="MINUTES",
        help="under torchrun: how long a rank waits for the others at any one point (rank 0's profile, which "
        "the others wait for, included) before the run ends naming the wait (default 60)",
    )


def _search_arguments(p: argparse.ArgumentParser) -> None:
    model_arguments(p)
    p.add_argument(
        "--budget",
        metavar="B",
        help="largest allowed drop of the metric from all-fp32: in the metric's units (0.01) or relative to "
        "the fp32 metric's magnitude (1%%); default 1%%",
    )
    study_arguments(p, "the model's name")
    p.add_argument(
        "--time-every-trial",
        action="store_true",
        help="time every trial, also one the profile's layer times predict too slow to be a finalist "
        "(by default those are left untimed, and the trials stop once none untried can win)",
    )
    p.add_argument(
        "--time-budget",
        type=parse_decimal,
        metavar="MINUTES",
        help="minutes the whole search may take: the trials stop where the final re-measure still fits, "
        "and the answer is chosen from what was measured (default: no limit but --trials)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also re-measure uniform bf16 compiled with CUDA graphs (torch.compile mode='reduce-overhead'), "
        "what speeds a host-bound step: a way to compile, shown beside the policies, never chosen (compiled, cuda)",
    )


def _sweep_arguments(p: argparse.ArgumentParser) -> None:
    model_arguments(p)
    p.add_argument(
        "--budgets",
        required=True,
        metavar="B1,B2,...",
        help="comma-separated budgets, e.g. 0,0.002,0.005,0.01,0.02 (metric units) or 0,0.5%%,1%%,2%% (of the fp32 metric)",
    )
    study_arguments(p, "the model's name + '-sweep'")


def search_settings(args: argparse.Namespace, device: torch.device, budget=None):
    """The settings, checked before the model is loaded (config.search_config, as the Python API builds them): a
    search's budget as given (the pipeline resolves it), a sweep's none (its budgets go to the sweep)."""
    try:
        return search_config(
            device=device,
            budget=budget,
            compile=args.compile,
            mode=args.mode,
            train_steps=args.train_steps,
            noise_runs=args.noise_runs,
            max_memory=args.max_memory,
            numerics=args.numerics,
            spell=lambda name: "--" + name.replace("_", "-"),
            trials=args.trials,
            seed=args.seed,
            storage=args.storage,
            study_name=args.study,
            progress=not args.quiet,
            remeasure=args.remeasure,
            cuda_graphs=getattr(args, "cuda_graphs", False),  # search's alone: a sweep's table has no row for it
            objective=args.objective,
            target=getattr(args, "target", None),
            predict_speed=not getattr(args, "time_every_trial", False),
            time_budget=_time_budget(args),
            run_steps=args.run_steps,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _space_check(config: SearchConfig) -> Callable[[SearchSpace], object]:
    """The goal's check of the space file (Goal.check_space, which the pipeline asks again), for prepare_model to
    ask before model.py is built."""
    return lambda space: config.objective.check_space(space, config)


def _time_budget(args: argparse.Namespace) -> float | None:
    """--time-budget MINUTES as SearchConfig's seconds."""
    minutes = getattr(args, "time_budget", None)
    if minutes is None:
        return None
    if not (math.isfinite(minutes) and minutes > 0):
        raise UserError(f"--time-budget {minutes:g}: give the minutes the whole search may take, a number > 0, e.g. 10")
    return minutes * 60.0


def _budgets(args: argparse.Namespace, flag: str, value: str):
    try:
        return parse_budget_list(value)
    except ValueError as exc:
        raise UserError(f"{flag} {value}: {exc}") from None


def _announce(args: argparse.Namespace, flag: str):
    """pipeline.run's `announce`: each relative budget, once resolved, said on stderr."""
    default = " (the default; --budget sets another)" if flag == "--budget" and args.budget is None else ""

    def tell(budgets) -> None:
        for given in budgets.given.values():
            say(args, f"autoprec: budget {given}{default}")

    return tell


def cmd_search(args: argparse.Namespace) -> int:
    specs = _budgets(args, "--budget", DEFAULT if args.budget is None else args.budget)
    if len(specs) != 1:
        raise UserError(f"--budget {args.budget}: one budget; for several, run autoprec sweep --budgets {args.budget}")
    device = model_device(args)
    config = search_settings(args, device, budget=specs[0])
    task, space, workload = prepare_model(args, device, compiled=config.compile, check_space=_space_check(config))
    out = args.out_dir = out_dir(args, task)
    command = command_line("search", config.storage)
    result = search_and_report(workload, space, config, out, command=command, announce=_announce(args, "--budget"))
    if result is None:  # a rank that took its part in a sharded search; rank 0 reports it
        return 0
    if args.json:
        print_json(args, {"policy_file": str(out / "policy.json"), "policy": result.policy.to_dict()}, allow_nan=False)
        return 0
    if not args.quiet:
        print(result.summary())
        print(
            f"\nwrote {out / 'policy.json'}, profile.csv, profile.json, grad_ranges.csv, trials.csv, finalists.csv, summary.md, profile.png, "
            f"grad_ranges.png (study {result.study_name!r} in {result.storage})"
        )
        measured = result.policy.measured or {}
        estimate = measured.get("estimate")
        if isinstance(estimate, dict) and estimate.get("what"):  # the goal's value is an estimate: said last, as one
            print(f"{measured.get('chosen')}: {estimate['what']}")
    return 0


def command_line(verb: str, storage: str | None) -> str:
    """The command line as the user typed it, for the markdown reports; a database password in --storage (in
    whatever form the option was given: --storage URL, --storage=URL, --stor URL) hidden."""
    args = sys.argv[2:] if not storage else [arg.replace(storage, hide_credentials(storage)) for arg in sys.argv[2:]]
    return " ".join(["autoprec", verb, *args])


def cmd_sweep(args: argparse.Namespace) -> int:
    specs = _budgets(args, "--budgets", args.budgets)
    device = model_device(args)
    config = search_settings(args, device)
    task, space, workload = prepare_model(args, device, compiled=config.compile, check_space=_space_check(config))
    out = args.out_dir = out_dir(args, task)
    if config.study_name is None:  # beside a search's study in the same storage, not mixed with it
        config = dataclasses.replace(config, study_name=f"{task.name}-sweep")
    command = command_line("sweep", config.storage)
    result = sweep_and_report(workload, space, specs, config, out, command=command, announce=_announce(args, "--budgets"))
    if result is None:  # a rank that took its part in a sharded sweep; rank 0 reports it
        return 0
    if args.json:
        rows = [
            {"budget": b, "budget_given": r.budget_given, "policy_file": str(out / r.policy_file), "policy": p.to_dict()}
            for (b, p), r in zip(result.policies.items(), result.table)
        ]
        print_json(args, {"sweep_csv": str(out / "sweep.csv"), "budgets": rows}, allow_nan=False)
        return 0
    if not args.quiet:
        print(result.summary())
        files = ", ".join(r.policy_file for r in result.table)
        print(
            f"\nwrote {out / 'sweep.csv'}, sweep.md, pareto.png, sweep_trials.csv, sweep_finalists.csv, {files} "
            f"(study {result.study_name!r} in {result.storage})"
        )
    return 0


SEARCH = Verb(
    "search", "profile the model, search per-layer formats, write a verified policy.json", _search_arguments, cmd_search
)
SWEEP = Verb(
    "sweep",
    "one two-objective study (speedup or peak memory, and metric drop) and a verified policy for each of several budgets",
    _sweep_arguments,
    cmd_sweep,
)
