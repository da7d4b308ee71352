"""autoprec's command line: the verbs (autoprec/tune/_commands/, each with its own arguments) under one parser, and
what the process around them owns: the plugins loaded first, the logs, a torchrun job's process group, signals, and
how it ends. A user's mistake exits 2 with one line."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.metadata
import os
import select
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from autoprec.errors import RankFailed, UserError, printable
from autoprec.tune._commands import export, predict, profile, search, show, validate
from autoprec.tune._commands._shared import GLOBAL_FLAGS, Verb
from autoprec.tune._core._plugins import GROUP as PLUGIN_GROUP
from autoprec.tune._core._plugins import load_plugins
from autoprec.tune._log_noise import LibraryNoise, log_setup

EXIT_USER_ERROR = 2
# What the shell reports for a Unix tool that SIGPIPE ended (128 + 13): `autoprec show p.json | head` stops as `cat` does
EXIT_BROKEN_PIPE = 141

# the verbs, in the order --help lists them
VERBS: tuple[Verb, ...] = (
    search.SEARCH,
    search.SWEEP,
    profile.PROFILE,
    predict.PREDICT,
    show.SHOW,
    export.EXPORT,
    export.VERIFY,
    validate.VALIDATE,
)


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
        # every rank done talking before any tears the group down: a rank destroying gloo while its peer still
        # talked aborted the peer (SIGABRT, "terminate called without an active exception") after a finished search
        dist.barrier()
    finally:
        dist.destroy_process_group()


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


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes (an unknown verb or option, a missing argument, a value it refuses) are one
    line, as every other user error is, with where the options are listed instead of the whole usage block. Its
    subparsers are of this class too (add_subparsers' default)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # no abbreviations: `--plug FILE` was read as --plugin by the parser but never loaded (plugins are loaded
        # before it, by their whole name), and an option added later would change what an abbreviation means
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self._refuse(self.prog, message)

    def _refuse(self, prog: str, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{prog}: error: {printable(message)} ({prog} --help lists the options)\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def, override]
        # a verb's parser hands the options it does not know up to this one: named with the verb whose --help lists
        # the right ones (`autoprec search m.py --bogus`), not with the top level's
        argv = list(sys.argv[1:] if args is None else args)
        if self._subparsers is not None:  # the top level: an unknown option before the verb would take the next word as
            self._refuse_unknown_before_the_verb(argv)  # the verb (`--plug FILE`: "invalid choice: FILE")
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            verb = getattr(parsed, "verb", None)
            after = verb in argv and extras[0] in argv and argv.index(extras[0]) > argv.index(verb)
            self._refuse(f"{self.prog} {verb}" if after else self.prog, f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _refuse_unknown_before_the_verb(self, argv: Sequence[str]) -> None:
        known = self._option_string_actions
        tokens = iter(argv)
        for token in tokens:
            if not token.startswith("-"):  # the verb
                return
            option = token.partition("=")[0]
            if option not in known:
                # a bare "-" or "--" resembles no option in particular
                typed = bool(option.lstrip("-"))
                close = (
                    ([o for o in known if o.startswith(option)] or difflib.get_close_matches(option, list(known), n=1))
                    if typed
                    else []
                )
                hint = f"; did you mean {close[0]}? (options are not abbreviated)" if close else ""
                self._refuse(self.prog, f"unrecognized arguments: {token}{hint}")
            if token == option and known[option].nargs is None:  # `--plugin X`: X is its value, not the verb
                next(tokens, None)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autoprec", description="Per-layer precision tuning for PyTorch training, measured on your device.")
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
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="{" + ",".join(v.name for v in VERBS) + "}")
    for verb in VERBS:  # each adds its own arguments, read from the registries now (the plugins are loaded)
        verb.add_to(verbs)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    plugins, debug = _before_the_verb(argv)
    try:  # before the parser is built: --objective, --target and --to offer what the plugins register
        # a plugin's prints go to stderr: stdout is the result's alone (--json's one object), and --json is not read yet
        with contextlib.redirect_stdout(sys.stderr):
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
