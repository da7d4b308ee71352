"""autoprec's command line: thin verbs over the library. A user's mistake exits 2 with one line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import traceback
from pathlib import Path

import torch

from autoprec.errors import UserError
from autoprec.files import write_text

EXIT_USER_ERROR = 2


def _device(value: str) -> torch.device:
    try:
        dev = torch.device(value)
    except RuntimeError:
        raise UserError(f"--device: unknown device {value!r}; use cpu or cuda (cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {value}: CUDA is not available here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"--device {value}: autoprec measures on cpu or cuda, got {dev.type}")
    return dev


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _compile(args: argparse.Namespace) -> bool:
    """--compile / --no-compile as given; by default compiled on CUDA (how GPU training runs, and where fp8
    pays only compiled) and eager elsewhere (inductor's CPU code is not what a CPU user is likely to train with)."""
    if args.compile is not None:
        return bool(args.compile)
    try:
        return torch.device(args.device).type == "cuda"
    except RuntimeError:  # a bad --device is reported by _device, with the choices
        return False


def _out_dir(args: argparse.Namespace, task) -> Path:
    return Path(args.out) if args.out else Path("results") / task.name


def _prepare(args: argparse.Namespace):
    from autoprec.tune.space import load_space
    from autoprec.tune.task import load_task, prepare

    task = load_task(args.model)
    space = load_space(args.space)
    device = _device(args.device)
    workload = prepare(task, device)
    how = "compiled" if _compile(args) else "eager"
    print(f"autoprec: {task.path} on {device}, {how}", file=sys.stderr)
    return task, space, workload


def _search_config(args: argparse.Namespace, budget: float | None = None):
    from autoprec.tune.searcher import Mode, SearchConfig, parse_mode

    budget = args.budget if budget is None else budget
    try:
        mode = parse_mode(args.mode)
        if mode is Mode.WEIGHTS:
            given = [flag for flag, value in (("--train-steps", args.train_steps), ("--noise-runs", args.noise_runs)) if value is not None]
            if given:
                verb = "apply" if len(given) > 1 else "applies"
                raise ValueError(f"{' and '.join(given)} {verb} only to --mode train (the mode is {mode.value})")
        train = {k: v for k, v in (("train_steps", args.train_steps), ("noise_runs", args.noise_runs)) if v is not None}
        return SearchConfig(
            budget=budget, trials=args.trials, seed=args.seed, storage=args.storage, study_name=args.study, mode=mode,
            compile=_compile(args), **train,
        )  # fmt: skip
    except ValueError as exc:
        raise UserError(str(exc)) from None


def cmd_search(args: argparse.Namespace) -> int:
    from autoprec.tune.report import plot_all, search_markdown, search_summary
    from autoprec.tune.searcher import search

    config = _search_config(args)
    task, space, workload = _prepare(args)
    out = _out_dir(args, task)
    result = search(workload, space, config, out)
    write_text(out / "summary.md", search_markdown(result, _command("search")))
    pngs = plot_all(result.profile, out, title=f"{task.name} on {result.profile.device}")
    print(search_summary(result))
    names = ", ".join(p.name for p in pngs)
    print(f"\nwrote {out / 'policy.json'}, profile.csv, grad_ranges.csv, trials.csv, finalists.csv, summary.md, {names} "
          f"(study {result.study_name!r} in {result.storage})")  # fmt: skip
    return 0


def _command(verb: str) -> str:
    """The command line as the user typed it, for the markdown reports."""
    return " ".join(["autoprec", verb, *sys.argv[2:]])


def cmd_sweep(args: argparse.Namespace) -> int:
    from autoprec.tune.report import plot_all, plot_pareto, sweep_summary
    from autoprec.tune.sweeper import parse_budgets, sweep

    try:
        budgets = parse_budgets(args.budgets)
    except ValueError as exc:
        raise UserError(f"--budgets: {exc}") from None
    config = _search_config(args, budget=budgets[-1])
    task, space, workload = _prepare(args)
    out = _out_dir(args, task)
    if config.study_name is None:  # beside a search's study in the same storage, not mixed with it
        config = dataclasses.replace(config, study_name=f"{task.name}-sweep")
    result = sweep(workload, space, budgets, config, out)
    plot_pareto(result, out / "pareto.png", title=f"{task.name} on {result.profile.device}")
    plot_all(result.profile, out, title=f"{task.name} on {result.profile.device}")
    write_text(out / "sweep.md", _sweep_markdown(result))
    print(sweep_summary(result))
    files = ", ".join(result.table["policy_file"])
    print(f"\nwrote {out / 'sweep.csv'}, sweep.md, pareto.png, sweep_trials.csv, sweep_finalists.csv, {files} "
          f"(study {result.study_name!r} in {result.storage})")  # fmt: skip
    return 0


def _sweep_markdown(result) -> str:
    from autoprec.tune.report import front_rows, markdown_table, profile_summary, sweep_summary

    command = _command("sweep")
    name = next(iter(result.policies.values())).measured["model"]
    return (
        f"# autoprec sweep: {name}\n\n`{command}`\n\n## Policy per budget\n\n{sweep_summary(result, markdown=True)}\n\n"
        f"![speedup against metric drop](pareto.png)\n\n"
        f"## Pareto front of the study (trial measurements)\n\n"
        f"{markdown_table(['trial', 'metric drop', 'speedup', 'spread'], front_rows(result.front))}\n\n"
        f"## Profile (one layer lowered at a time)\n\n{profile_summary(result.profile.table, markdown=True)}\n"
    )


def cmd_profile(args: argparse.Namespace) -> int:
    from autoprec.tune.profiler import ProfileConfig, profile
    from autoprec.tune.report import gradient_summary, plot_all, profile_summary

    from autoprec.tune.searcher import check_out_dir

    task, space, workload = _prepare(args)
    out = _out_dir(args, task)
    check_out_dir(workload, out)
    prof = profile(workload, space, ProfileConfig(compile=_compile(args)))
    path = prof.save(out)
    pngs = plot_all(prof, out, title=f"{task.name} on {prof.device}")
    print(profile_summary(prof.table))
    print()
    print(gradient_summary(prof.table, prof.advice()))
    names = ", ".join(p.name for p in [path.with_name("grad_ranges.csv"), *pngs])
    print(f"\nfp32 metric {prof.fp32_metric:.6g} ({prof.metric_name}) on {prof.device}; wrote {path}, {names}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from autoprec.policy import load_policy
    from autoprec.tune.report import show_policy

    print(show_policy(load_policy(args.policy), markdown=args.markdown))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoprec", description="Per-layer precision tuning for PyTorch training, measured on your device.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="{search,sweep,profile,show}")

    def model_verb(name: str, help_text: str) -> argparse.ArgumentParser:
        p = verbs.add_parser(name, help=help_text, description=help_text)
        p.add_argument("model", help="path to a model.py (build_model, batches, loss_fn; optional evaluate, optimizer)")
        p.add_argument("--device", default=_default_device(), help="where to measure (default: cuda when available, else cpu)")
        p.add_argument("--out", help="output directory (default: results/<model name>)")
        p.add_argument("--space", help="search-space YAML (default: the shipped search_spaces/default.yaml)")
        p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="time steps with the model under torch.compile, as users who compile train "
                            "(default: on for cuda, off for cpu)")  # fmt: skip
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        return p

    def study_options(p: argparse.ArgumentParser, default_study: str) -> None:
        p.add_argument("--trials", type=int, help="trials in the study, counting earlier runs of it (default: the space's)")
        p.add_argument("--storage", help="Optuna storage URL or journal file (default: <out>/study.journal)")
        p.add_argument("--study", help=f"study name (default: {default_study}); the same name resumes")
        p.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
        p.add_argument("--mode", default="weights", metavar="{weights,train}",
                       help="what the budget applies to: the metric of the given weights with the policy (weights, "
                            "default), or after --train-steps training steps against fp32 trained alike (train)")  # fmt: skip
        p.add_argument("--train-steps", type=int, metavar="K", help="train mode: training steps per candidate (default 50)")
        p.add_argument("--noise-runs", type=int, metavar="R",
                       help="train mode: fp32 runs with seeds 0..R-1 whose spread is the noise floor (default 3)")  # fmt: skip

    s = model_verb("search", "profile the model, search per-layer formats, write a verified policy.json")
    s.add_argument("--budget", type=float, required=True, help="largest allowed drop of the metric from all-fp32, in the metric's units")
    study_options(s, "the model's name")
    s.set_defaults(func=cmd_search)

    w = model_verb("sweep", "one two-objective study (speedup, metric drop) and a verified policy for each of several budgets")
    w.add_argument("--budgets", required=True, metavar="B1,B2,...",
                   help="comma-separated budgets, e.g. 0,0.002,0.005,0.01,0.02 (metric units)")  # fmt: skip
    study_options(w, "the model's name + '-sweep'")
    w.set_defaults(func=cmd_sweep)

    p = model_verb("profile", "measure each layer's sensitivity, gradient ranges and speed in each format; write profile.csv, grad_ranges.csv and heat maps")
    p.set_defaults(func=cmd_profile)

    sh = verbs.add_parser("show", help="print a policy file for a person", description="print a policy file for a person")
    sh.add_argument("policy", help="path to a policy.json")
    sh.add_argument("--markdown", action="store_true", help="markdown tables")
    sh.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sh.set_defaults(func=cmd_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="autoprec: %(message)s")
    if args.verb in ("search", "sweep") and not args.debug:  # process-wide settings belong here, not in the library
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the progress bar shows the trials
    try:
        return args.func(args)
    except UserError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"autoprec: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("autoprec: interrupted; a search resumes when run again with the same --study and --storage", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
