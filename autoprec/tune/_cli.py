"""autoprec's command line: thin verbs over the library. A user's mistake exits 2 with one line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import math
import os
import select
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from autoprec import devices
from autoprec.errors import RankFailed, UserError, printable
from autoprec.formats import default_device
from autoprec.tune._core._numbers import parse_decimal, parse_integer
from autoprec.tune._core._plugins import GROUP as PLUGIN_GROUP
from autoprec.tune._core._plugins import load_plugins
from autoprec.tune._log_noise import LibraryNoise, log_setup

if TYPE_CHECKING:
    from autoprec.tune.export import ExportTarget

EXIT_USER_ERROR = 2
# What the shell reports for a Unix tool that SIGPIPE ended (128 + 13): `autoprec show p.json | head` stops as `cat` does
EXIT_BROKEN_PIPE = 141


def _device(value: str) -> torch.device:
    """--device: a registered device type (autoprec.devices), available here, its index one of those present."""
    try:
        dev = torch.device(value)
    except RuntimeError:
        numbered = "".join(f" ({t}:N)" for t in devices.registered() if devices.device_for(t).numbered)
        raise UserError(f"--device: unknown device {value!r}; use {devices.choices()}{numbered}") from None
    try:
        kind = devices.device_for(dev)
    except devices.UnknownDeviceError as exc:
        raise UserError(f"--device {value}: {exc}") from None
    if not kind.is_available():
        raise UserError(f"--device {value}: {kind.label} is not available here; use --device {devices.default_device()}")
    count = kind.device_count() if kind.numbered else None
    if count is not None and dev.index is not None and dev.index >= count:
        raise UserError(
            f"--device {value}: this machine has {count} {kind.unit}{'s' if count != 1 else ''} "
            f"({dev.type}:0 to {dev.type}:{count - 1})"
        )
    return dev


def _compile(args: argparse.Namespace, device: torch.device) -> bool:
    """--compile / --no-compile as given, else the device's default (config.default_compile)."""
    from autoprec.tune._core._config import default_compile

    return bool(args.compile) if args.compile is not None else default_compile(device)


def _out_dir(args: argparse.Namespace, task) -> Path:
    """--out, else results/<the model's name>, a name made safe to stay inside results/ (said when changed)."""
    if args.out:
        return Path(args.out)
    name = folder_name(task.name)
    if name != task.name:
        logging.getLogger("autoprec").warning(
            "the model's name %r is not a folder name inside results/: writing to results/%s (--out sets another)",
            task.name,
            name,
        )
    return Path("results") / name


def folder_name(name: str) -> str:
    """`name` as one folder name that cannot leave its parent: path separators become "_", and so do the dots
    of "." and ".." (a model file named "...py" has the stem ".."), and an empty name is "_"."""
    name = name.replace("/", "_").replace("\\", "_")  # POSIX's and Windows' separators, on either
    return "_" * max(1, len(name)) if name in ("", ".", "..") else name


def _quiet_torchao() -> None:
    """Import torchao before model.py does (through transformers, say), with its loader's noise (CUDA extensions a CPU
    lacks, pytree deprecations) kept out of the output: imported first by the user's libraries, it prints it."""
    from autoprec.formats.float8 import import_float8

    try:
        import_float8()
    except Exception:  # a broken torchao install shows where fp8 is used, not in every command here
        pass


def _prepare(args: argparse.Namespace, device: torch.device, *, compiled: bool):
    """model.py loaded and prepared on `device` (_model_device's), the search space with --exclude applied, and the
    workload, sharded under torchrun; one line says where it runs and how (`compiled`: as the config decided)."""
    from autoprec.tune._core._space import load_space
    from autoprec.tune._measure._task import load_task, prepare

    _quiet_torchao()
    task = load_task(args.model)
    if getattr(args, "library_noise", None) is not None:  # a library model.py imported may have set up its own handler
        args.library_noise.cover()
    space = load_space(args.space)
    workload = prepare(task, device)
    try:
        space = space.with_excludes(args.exclude or (), workload.model)
    except ValueError as exc:
        raise UserError(f"--{exc}") from None
    how = "compiled" if compiled else "eager"
    ranks = getattr(args, "ranks", None)
    if ranks is not None:
        workload = _sharded(args, task, workload)
        how += f", sharded over {ranks[1]} ranks by {task.path.name}'s parallelize"
    _say(args, f"autoprec: {task.path} on {device}, {how}")
    return task, space, workload


def _model_device(args: argparse.Namespace) -> torch.device:
    """--device, checked once (_device) for everything the command does with it; under torchrun each rank's own GPU
    (cuda -> cuda:LOCAL_RANK), as torchrun's workers train."""
    device = _device(args.device)
    ranks = getattr(args, "ranks", None)
    if ranks is None or device.index is not None or not devices.device_for(device).numbered:
        return device
    return torch.device(device.type, ranks[2])


def _sharded(args: argparse.Namespace, task, workload):
    """The workload, run on every rank of this torchrun job together (_ranks.Ranks), sharded by model.py's
    parallelize(model, mesh)."""
    from autoprec.tune._measure._ranks import sharded

    if task.parallelize is None:
        raise UserError(
            f"{task.path}: torchrun started {args.ranks[1]} ranks, but the file defines no parallelize(model, mesh) to "
            "shard the model over them; define one (fully_shard each block, then the model: docs/sharded.md), or "
            "run autoprec without torchrun"
        )
    return sharded(workload, timeout_s=60 * args.rank_timeout)


@contextlib.contextmanager
def _torchrun(args: argparse.Namespace):
    """Under torchrun with more than one rank: torch.distributed's default group for the command (process-wide, so
    here, where the process is the CLI's), destroyed after; `args.ranks` = (rank, world size, local rank), else None."""
    from autoprec.tune._measure._ranks import torchrun_ranks

    args.ranks = torchrun_ranks(os.environ)
    if args.ranks is None:
        yield
        return
    if args.ranks[0]:  # rank 0 reports; the others' lines would repeat it
        args.quiet = True
    if args.verb not in ("search", "sweep"):
        raise UserError(
            f"autoprec {args.verb} runs in one process: run it without torchrun (under torchrun, autoprec searches "
            "and sweeps a model that trains sharded)"
        )
    if not (0 < args.rank_timeout <= 7 * 24 * 60):  # NaN too
        raise UserError(
            f"--rank-timeout {args.rank_timeout:g}: give the minutes a rank may wait, a number > 0 and at most a "
            "week (10080), e.g. 60"
        )
    import datetime

    import torch.distributed as dist

    if args.device.startswith("cuda") and torch.cuda.is_available():  # NCCL's collectives run on the rank's own GPU
        torch.cuda.set_device(args.ranks[2])
    dist.init_process_group(timeout=datetime.timedelta(minutes=args.rank_timeout))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _print_json(args: argparse.Namespace, result: object, **options) -> None:
    """--json's one result object, on the stdout main was given: the user's own prints went to stderr meanwhile."""
    print(json.dumps(result, **options), file=getattr(args, "result_stdout", None) or sys.stdout)


def _say(args: argparse.Namespace, line: str) -> None:
    """A progress line on stderr, unless --quiet or --json (stdout then holds only the result)."""
    if not (args.quiet or args.json):
        print(line, file=sys.stderr)


def _search_config(args: argparse.Namespace, device: torch.device, budget=None):
    """The settings, checked before the model is loaded (config.search_config, as the Python API builds them): a
    search's budget as given (the pipeline resolves it), a sweep's none (its budgets go to the sweep)."""
    from autoprec.tune._core._config import search_config

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


def _time_budget(args: argparse.Namespace) -> float | None:
    """--time-budget MINUTES as SearchConfig's seconds."""
    minutes = getattr(args, "time_budget", None)
    if minutes is None:
        return None
    if not (math.isfinite(minutes) and minutes > 0):
        raise UserError(f"--time-budget {minutes:g}: give the minutes the whole search may take, a number > 0, e.g. 10")
    return minutes * 60.0


def _budgets(args: argparse.Namespace, flag: str, value: str):
    from autoprec.tune._core._budget import parse_budget_list

    try:
        return parse_budget_list(value)
    except ValueError as exc:
        raise UserError(f"{flag} {value}: {exc}") from None


def _announce(args: argparse.Namespace, flag: str):
    """pipeline.run's `announce`: each relative budget, once resolved, said on stderr."""
    default = " (the default; --budget sets another)" if flag == "--budget" and args.budget is None else ""

    def say(budgets) -> None:
        for given in budgets.given.values():
            _say(args, f"autoprec: budget {given}{default}")

    return say


def cmd_search(args: argparse.Namespace) -> int:
    from autoprec.tune._api import search_and_report
    from autoprec.tune._core._budget import DEFAULT

    specs = _budgets(args, "--budget", DEFAULT if args.budget is None else args.budget)
    if len(specs) != 1:
        raise UserError(f"--budget {args.budget}: one budget; for several, run autoprec sweep --budgets {args.budget}")
    device = _model_device(args)
    config = _search_config(args, device, budget=specs[0])
    task, space, workload = _prepare(args, device, compiled=config.compile)
    out = args.out_dir = _out_dir(args, task)
    command = _command("search", config.storage)
    result = search_and_report(workload, space, config, out, command=command, announce=_announce(args, "--budget"))
    if result is None:  # a rank that took its part in a sharded search; rank 0 reports it
        return 0
    if args.json:
        _print_json(args, {"policy_file": str(out / "policy.json"), "policy": result.policy.to_dict()}, allow_nan=False)
        return 0
    if not args.quiet:
        print(result.summary())
        print(
            f"\nwrote {out / 'policy.json'}, profile.csv, grad_ranges.csv, trials.csv, finalists.csv, summary.md, profile.png, "
            f"grad_ranges.png (study {result.study_name!r} in {result.storage})"
        )
        measured = result.policy.measured or {}
        estimate = measured.get("estimate")
        if isinstance(estimate, dict) and estimate.get("what"):  # the goal's value is an estimate: said last, as one
            print(f"{measured.get('chosen')}: {estimate['what']}")
    return 0


def _command(verb: str, storage: str | None) -> str:
    """The command line as the user typed it, for the markdown reports; a database password in --storage (in
    whatever form the option was given: --storage URL, --storage=URL, --stor URL) hidden."""
    from autoprec.tune._core._credentials import hide_credentials

    args = sys.argv[2:] if not storage else [arg.replace(storage, hide_credentials(storage)) for arg in sys.argv[2:]]
    return " ".join(["autoprec", verb, *args])


def cmd_sweep(args: argparse.Namespace) -> int:
    from autoprec.tune._api import sweep_and_report

    specs = _budgets(args, "--budgets", args.budgets)
    device = _model_device(args)
    config = _search_config(args, device)
    task, space, workload = _prepare(args, device, compiled=config.compile)
    out = args.out_dir = _out_dir(args, task)
    if config.study_name is None:  # beside a search's study in the same storage, not mixed with it
        config = dataclasses.replace(config, study_name=f"{task.name}-sweep")
    command = _command("sweep", config.storage)
    result = sweep_and_report(workload, space, specs, config, out, command=command, announce=_announce(args, "--budgets"))
    if result is None:  # a rank that took its part in a sharded sweep; rank 0 reports it
        return 0
    if args.json:
        rows = [
            {"budget": b, "budget_given": r.budget_given, "policy_file": str(out / r.policy_file), "policy": p.to_dict()}
            for (b, p), r in zip(result.policies.items(), result.table)
        ]
        _print_json(args, {"sweep_csv": str(out / "sweep.csv"), "budgets": rows}, allow_nan=False)
        return 0
    if not args.quiet:
        print(result.summary())
        files = ", ".join(r.policy_file for r in result.table)
        print(
            f"\nwrote {out / 'sweep.csv'}, sweep.md, pareto.png, sweep_trials.csv, sweep_finalists.csv, {files} "
            f"(study {result.study_name!r} in {result.storage})"
        )
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from autoprec.tune._core._config import ProfileConfig
    from autoprec.tune._measure._profiler import profile
    from autoprec.tune._report._plots import plot_all
    from autoprec.tune._report._report import breaks, breaks_summary, gradient_summary, profile_summary
    from autoprec.tune._search._out_dir import claim_out_dir

    device = _model_device(args)
    compiled = _compile(args, device)
    task, space, workload = _prepare(args, device, compiled=compiled)
    out = _out_dir(args, task)
    with claim_out_dir(workload, out):
        prof = profile(workload, space, ProfileConfig(compile=compiled), progress=not args.quiet)
        path = prof.save(out)
        pngs = plot_all(prof, out, title=f"{task.name} on {prof.device}")
    if args.json:
        found = [b.to_dict() for b in breaks(prof.rows)]
        _print_json(
            args,
            {
                "profile_csv": str(path),
                "device": prof.device,
                "fp32_metric": prof.fp32_metric,
                "metric": prof.metric_name,
                "breaks": found,
            },
        )
        return 0
    if args.quiet:
        return 0
    print(profile_summary(prof.rows))
    print()
    print(gradient_summary(prof.rows, prof.advice()))
    names = ", ".join(p.name for p in [path.with_name("grad_ranges.csv"), *pngs])
    print(f"\nfp32 metric {prof.fp32_metric:.6g} ({prof.metric_name}) on {prof.device}; wrote {path}, {names}")
    print()
    print(breaks_summary(prof.rows))  # last: the short answer to "which layer breaks?"
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from autoprec.policy import load_policy
    from autoprec.tune.export import default_path, export, options

    policy = load_policy(args.policy)
    source = Path(args.policy)
    out = Path(args.out) if args.out else default_path(source, args.to)
    if out.exists() and out.samefile(source):  # by the file itself: a link or another spelling of its path too
        raise UserError(f"--out {out}: that is the policy file {source}; give the export another file (or leave out --out)")
    given = {option.dest: getattr(args, option.dest) for option in options()}  # the targets' own options (None: not given)
    try:
        left_out = export(policy, args.to, out, source=str(source), **given)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write it ({exc.strerror or exc})") from None
    if not (args.json or args.quiet):  # the path and the lines name the policy's file and layers: escaped
        print(f"wrote {printable(str(out))}")
        for line in left_out:
            print(f"not expressed: {printable(line)}")
    checked = _verified(args, out, policy, args.check, args.to, flag="--check") if args.check else None
    if args.json:
        _print_json(args, {"file": str(out), "not_expressed": left_out, **({"check": checked.to_dict()} if checked else {})})
    return _verify_code(checked)


def _verified(args: argparse.Namespace, exported: Path, policy, model: str, target: str | None, *, flag: str = "--model"):
    """The verification of `exported` on `model`'s linears (autoprec verify), its table printed unless --json or
    --quiet; `flag` named `model`."""
    from autoprec.tune.export.verify import linear_names, table, verify

    result = verify(exported, policy, linear_names(model, flag=flag), target)
    if not (args.json or args.quiet):
        print(table(result))
    return result


def _verify_code(result) -> int:
    """1 when a linear runs otherwise than the policy says under the exported file, naming them on stderr."""
    if result is None or not result.differing:
        return 0
    print(f"autoprec: the export differs from the policy at {', '.join(printable(n) for n in result.differing)}", file=sys.stderr)
    return 1


def cmd_verify(args: argparse.Namespace) -> int:
    from autoprec.policy import load_policy

    result = _verified(args, Path(args.exported), load_policy(args.policy), args.model, args.to)
    if args.json:
        _print_json(args, result.to_dict())
    return _verify_code(result)


def cmd_show(args: argparse.Namespace) -> int:
    from autoprec.policy import load_policy
    from autoprec.tune._report._show import show_policy

    policy = load_policy(args.policy)
    if args.json:
        _print_json(args, policy.to_dict(), indent=2)
    else:
        print(show_policy(policy, markdown=args.markdown))
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from autoprec.tune._measure._predict import command

    result, text = command(args.model, target=args.target, policy=args.policy, fmt=args.format, tokens=args.tokens)
    if args.json:
        _print_json(args, result, indent=2)
    else:
        print(text)
    return 0


GLOBAL_FLAGS = (
    ("--debug", "show tracebacks and debug logs"),
    ("--quiet", "no progress bars and no tables: warnings, errors and the exit code only"),
    ("--json", "print the result as one JSON object on stdout (progress stays on stderr)"),
)


def _global_flags(p: argparse.ArgumentParser) -> None:
    """The top-level flags, accepted after the verb too (`autoprec search m.py --json`), and named under the verb's
    --help (a user reading `autoprec predict --help` would not find --json otherwise)."""
    for flag, _ in GLOBAL_FLAGS:
        p.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.epilog = "also here: " + "; ".join(f"{flag}: {text}" for flag, text in GLOBAL_FLAGS)


def _version() -> str:
    try:
        return importlib.metadata.version("autoprec")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it, so a BrokenPipeError is ours to stop on, not one from a
    pipe or socket the model's own code uses. Where poll cannot tell (Windows), it is taken to be stdout's."""
    try:
        poller = select.poll()
        poller.register(sys.__stdout__.fileno(), select.POLLOUT)  # type: ignore[union-attr]
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return True


def _silence_stdout() -> None:
    """stdout pointed at devnull, so the interpreter's flush of what is still buffered at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno())  # type: ignore[union-attr]
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def _export_file_names(targets: Sequence[ExportTarget]) -> str:
    """'<name>_<target>.py, or .json for megatron': the suffix most targets write, then the others'."""
    suffixes = [t.suffix for t in targets]
    usual = max(suffixes, key=suffixes.count)
    others = [f"{t.suffix} for {t.name}" for t in targets if t.suffix != usual]
    return f"<name>_<target>{usual}" + (f", or {', '.join(others)}" if others else "")


def _before_the_verb(argv: Sequence[str]) -> tuple[list[str], bool]:
    """The --plugin values and whether --debug is given, among the options before the verb (where --plugin goes),
    read before the parser is built; the parser reads them again and reports a mistake in them."""
    plugins, debug = [], False
    tokens = iter(argv)
    for token in tokens:
        if token == "--plugin":
            plugins.append(next(tokens, ""))
        elif token.startswith("--plugin="):
            plugins.append(token.partition("=")[2])
        elif not token.startswith("-"):  # the verb
            break
        debug = debug or token == "--debug"
    return [p for p in plugins if p], debug


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoprec", description="Per-layer precision tuning for PyTorch training, measured on your device."
    )
    parser.add_argument("--version", action="version", version=f"autoprec {_version()}")
    for flag, text in GLOBAL_FLAGS:
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument(
        "--plugin",
        action="append",
        metavar="MODULE_OR_FILE",
        help="import a module (pkg.mod) or a .py file that registers goals, targets, export targets or format "
        f"families, before the options are read; repeatable (installed packages' {PLUGIN_GROUP} entry points are "
        "always loaded)",
    )
    from autoprec.tune._core._goal import DEFAULT_GOAL, objective_help, objective_metavar  # noqa: PLC0415 (loaded with autoprec.tune)
    from autoprec.tune._core._targets import targets as planned_for  # noqa: PLC0415 (--target's devices, not export's)

    verbs = parser.add_subparsers(dest="verb", required=True, metavar="{search,sweep,profile,predict,show,export,verify}")

    def model_verb(name: str, help_text: str) -> argparse.ArgumentParser:
        p = verbs.add_parser(name, help=help_text, description=help_text)
        p.add_argument("model", help="path to a model.py (build_model, batches, loss_fn; optional evaluate, optimizer)")
        p.add_argument(
            "--device", default=str(default_device()), help="where to measure (default: cuda when available, else cpu)"
        )
        p.add_argument("--out", help="output directory (default: results/<model name>)")
        p.add_argument("--space", help="search-space YAML (default: the shipped search_spaces/default.yaml)")
        p.add_argument(
            "--exclude",
            action="append",
            metavar="PATTERN",
            help="keep modules whose name matches (fnmatch: pooler, '*.lm_head') out of the search, with "
            "everything inside them; repeatable; added to the space file's exclude list",
        )
        p.add_argument(
            "--compile",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="time steps with the model under torch.compile, as users who compile train (default: on for cuda, off for cpu)",
        )
        _global_flags(p)
        return p

    def study_options(p: argparse.ArgumentParser, default_study: str) -> None:
        p.add_argument(
            "--trials", type=parse_integer, help="trials in the study, counting earlier runs of it (default: the space's)"
        )
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
        p.add_argument(
            "--train-steps", type=parse_integer, metavar="K", help="train mode: training steps per candidate (default 50)"
        )
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

    s = model_verb("search", "profile the model, search per-layer formats, write a verified policy.json")
    s.add_argument(
        "--budget",
        metavar="B",
        help="largest allowed drop of the metric from all-fp32: in the metric's units (0.01) or relative to "
        "the fp32 metric's magnitude (1%%); default 1%%",
    )
    study_options(s, "the model's name")
    s.add_argument(
        "--time-every-trial",
        action="store_true",
        help="time every trial, also one the profile's layer times predict too slow to be a finalist "
        "(by default those are left untimed, and the trials stop once none untried can win)",
    )
    s.add_argument(
        "--time-budget",
        type=parse_decimal,
        metavar="MINUTES",
        help="minutes the whole search may take: the trials stop where the final re-measure still fits, "
        "and the answer is chosen from what was measured (default: no limit but --trials)",
    )
    s.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also re-measure uniform bf16 compiled with CUDA graphs (torch.compile mode='reduce-overhead'), "
        "what speeds a host-bound step: a way to compile, shown beside the policies, never chosen (compiled, cuda)",
    )
    s.set_defaults(func=cmd_search)

    w = model_verb(
        "sweep",
        "one two-objective study (speedup or peak memory, and metric drop) and a verified policy for each of several budgets",
    )
    w.add_argument(
        "--budgets",
        required=True,
        metavar="B1,B2,...",
        help="comma-separated budgets, e.g. 0,0.002,0.005,0.01,0.02 (metric units) or 0,0.5%%,1%%,2%% (of the fp32 metric)",
    )
    study_options(w, "the model's name + '-sweep'")
    w.set_defaults(func=cmd_sweep)

    p = model_verb(
        "profile",
        "measure each layer's sensitivity, gradient ranges and speed in each format; write profile.csv, grad_ranges.csv and heat maps",
    )
    p.set_defaults(func=cmd_profile)

    pr = verbs.add_parser(
        "predict",
        help="predict a policy's training-step time on a target GPU from the model's shapes (no GPU needed)",
        description="predict the training-step time of uniform bf16 and of a policy or format on a target GPU, from "
        "the model's shapes on the meta device (docs/planning.md); a prediction with its error band, not a measurement",
    )
    pr.add_argument("model", help="path to a model.py (build_model, batches, loss_fn)")
    pr.add_argument("--target", required=True, metavar="{" + ",".join(t.name for t in planned_for()) + "}")
    which = pr.add_mutually_exclusive_group(required=True)
    which.add_argument("--policy", help="a policy.json to price")
    which.add_argument("--format", help="price every Linear in this format, the rest in bf16")
    pr.add_argument("--tokens", metavar="N", help="tokens (rows) per training step (default: one train batch's)")
    _global_flags(pr)
    pr.set_defaults(func=cmd_predict)

    sh = verbs.add_parser("show", help="print a policy file for a person", description="print a policy file for a person")
    sh.add_argument("policy", help="path to a policy.json")
    sh.add_argument("--markdown", action="store_true", help="markdown tables")
    _global_flags(sh)
    sh.set_defaults(func=cmd_show)

    from autoprec.tune.export import export_targets, options  # noqa: PLC0415 (light: the policy and formats only)

    # every registered target (autoprec.tune.export): its name, its file's suffix and the options it adds
    ex = verbs.add_parser(
        "export",
        help="write a policy's fp8 layers for another training tool",
        description="write a policy's fp8 layers for another training tool; what it cannot express is listed",
    )
    ex.add_argument("policy", help="path to a policy.json")
    ex.add_argument(
        "--to",
        required=True,
        choices=[t.name for t in export_targets()],
        help="; ".join(f"{t.name}: {t.summary}" for t in export_targets()),
    )
    ex.add_argument("--out", help=f"the file to write (default: beside the policy, {_export_file_names(export_targets())})")
    for option, names in options().items():
        ex.add_argument(
            option.flag, dest=option.dest, type=option.type, metavar=option.metavar, help=f"{', '.join(names)}: {option.help}"
        )
    ex.add_argument("--check", metavar="MODEL", help="then verify the file on MODEL's linears (as `autoprec verify`)")
    _global_flags(ex)
    ex.set_defaults(func=cmd_export)

    vf_help = "check that an exported file runs each linear of a model as the policy says, per GEMM, by the framework's rules"
    vf = verbs.add_parser("verify", help=vf_help, description=f"{vf_help}; exit 1 naming each linear that differs")
    vf.add_argument("exported", help="a file `autoprec export` wrote")
    vf.add_argument("--policy", required=True, help="the policy.json it was exported from")
    vf.add_argument("--model", required=True, help="the model.py (its build_model()'s linears), or a text file of module names")
    vf.add_argument("--to", choices=[t.name for t in export_targets()], help="the file's target (default: the one it names)")
    _global_flags(vf)
    vf.set_defaults(func=cmd_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    plugins, debug = _before_the_verb(argv)
    try:  # before the parser is built: --objective, --target and --to offer what the plugins register
        load_plugins(plugins)
    except UserError as exc:
        if debug:
            traceback.print_exc()
        print(f"autoprec: error: {printable(str(exc))}", file=sys.stderr)
        return EXIT_USER_ERROR
    args = build_parser().parse_args(argv)
    log_setup(args.debug)
    if args.verb in ("search", "sweep") and not args.debug:  # process-wide settings belong here, not in the library
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the progress bar shows the trials
    args.result_stdout = sys.stdout
    # Under --json stdout holds the one result object: a model.py that prints (at import, in build_model, in
    # loss_fn) prints to stderr. Process-wide, so here, in the CLI, which owns the process, not in the library.
    to_stderr = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with to_stderr, warnings.catch_warnings(), contextlib.ExitStack() as stack:
            stack.enter_context(_terminate_as_interrupt())
            stack.enter_context(_torchrun(args))
            if not args.debug:  # inductor's notes on the kernels it generates (--compile) say nothing to a user
                warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\._inductor")
                args.library_noise = stack.enter_context(LibraryNoise())
            code = args.func(args)
            for stream in (sys.stdout, args.result_stdout):  # here, where a reader that has gone is handled below
                stream.flush()
            return code
    except BrokenPipeError:
        if not _reader_gone():
            raise
        # `autoprec show p.json | head`: the reader has what it wanted. Unix tools die of SIGPIPE there, without a
        # word, and the shell reports 141; the same here, so `set -o pipefail` sees the output was cut short.
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except UserError as exc:
        if args.debug:
            traceback.print_exc()
        # a path or a value from a file, escaped
        print(f"autoprec: error{_which_rank(args)}: {printable(str(exc))}", file=sys.stderr)
        return EXIT_USER_ERROR
    except RankFailed as exc:  # another rank's failure, or a wait past --rank-timeout: named in its one line
        if args.debug:
            traceback.print_exc()
        print(f"autoprec: error{_which_rank(args)}: {printable(str(exc))}", file=sys.stderr)
        return 1
    except _Terminated:
        print(f"autoprec: stopped (SIGTERM){_resume_hint(args)}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"autoprec: interrupted{_resume_hint(args)}", file=sys.stderr)
        return 130


def _which_rank(args: argparse.Namespace) -> str:
    """' (rank N)' on a rank other than 0 of a torchrun job: every rank prints its own errors to the same terminal."""
    ranks = getattr(args, "ranks", None)
    return f" (rank {ranks[0]})" if ranks is not None and ranks[0] else ""


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a timeout, Slurm, Kubernetes) taken as Ctrl-C is: Optuna fails the running trial instead of leaving it
    RUNNING for good, the storage is left consistent and the user is told how to resume."""


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM raises _Terminated in the main thread while the command runs (process-wide: the CLI owns the process)."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return

    def terminate(signum, frame):
        raise _Terminated

    before = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _resume_hint(args: argparse.Namespace) -> str:
    """How to go on after Ctrl-C or SIGTERM: what is stored (a study, a profile, nothing yet), and the command that
    resumes a search from it."""
    if args.verb not in ("search", "sweep"):
        return ""
    given = [flag for flag, value in (("--out", args.out), ("--study", args.study), ("--storage", args.storage)) if value]
    same = f" (with the same {', '.join(given)})" if given else ""
    out = getattr(args, "out_dir", None)  # set once the model is ready and its folder known
    if out is not None and args.storage:  # a database or journal elsewhere: whether a trial finished is not known here
        return f"; any trials that finished are stored in --storage: run the same command again{same} to resume"
    if out is not None and (out / "study.journal").is_file():
        return f"; the trials so far are stored: run the same command again{same} to resume"
    if out is not None and any((out / d / "profile.csv").is_file() for d in (".", "sweep_profile")):
        return f"; no trial had finished; the profile is stored: run the same command again{same} to go on from it"
    return f"; nothing was stored yet (stopped before the profile finished): run the same command again{same} to start"


if __name__ == "__main__":
    sys.exit(main())
