"""What the command line's verbs share. Every verb: what a verb is (`Verb`: its name, its help, its own arguments and
what runs it), the global flags named under it, a progress line (`say`), the --json result. The verbs that load a
model.py (search, sweep, profile): their arguments, --device checked once, the model prepared on it (sharded under
torchrun), where its results go."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from autoprec import devices
from autoprec.errors import UserError
from autoprec.formats import default_device
from autoprec.formats.float8 import torchao_loading_quietly
from autoprec.tune._core._space import SearchSpace, load_space
from autoprec.tune._measure._ranks import agree_ready, sharded
from autoprec.tune._measure._task import load_task, prepare
from autoprec.tune._search._out_dir import check_not_a_file

# What every verb is and shares.

GLOBAL_FLAGS = (
    ("--debug", "show tracebacks and debug logs"),
    ("--quiet", "no progress bars and no tables: warnings, errors and the exit code only"),
    ("--json", "print the result as one JSON object on stdout (progress stays on stderr)"),
)


def global_flags(p: argparse.ArgumentParser) -> None:
    """The top-level flags, accepted after the verb too (`autoprec search m.py --json`), and named under the verb's
    --help (a user reading `autoprec predict --help` would not find --json otherwise)."""
    for flag, _ in GLOBAL_FLAGS:
        p.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.epilog = "also here: " + "; ".join(f"{flag}: {text}" for flag, text in GLOBAL_FLAGS)


@dataclasses.dataclass(frozen=True)
class Verb:
    """One verb: `arguments` adds its own options to its parser, `run` does it and returns the exit code."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None  # its --help's text (default: `help`)

    def add_to(self, verbs: argparse._SubParsersAction) -> argparse.ArgumentParser:
        """Its parser among the command line's verbs, with the global flags named under it."""
        p = verbs.add_parser(self.name, help=self.help, description=self.description or self.help)
        self.arguments(p)
        global_flags(p)
        p.set_defaults(func=self.run)
        return p


def say(args: argparse.Namespace, line: str) -> None:
    """A progress line on stderr, unless --quiet or --json (stdout then holds only the result)."""
    if not (args.quiet or args.json):
        print(line, file=sys.stderr)


def print_json(args: argparse.Namespace, result: object, **options) -> None:
    """--json's one result object, on the stdout main was given: the user's own prints went to stderr meanwhile."""
    print(json.dumps(result, **options), file=getattr(args, "result_stdout", None) or sys.stdout)


# What the verbs that load a model.py share.


def model_arguments(p: argparse.ArgumentParser) -> None:
    """The model.py and the options every model verb takes."""
    p.add_argument("model", help="path to a model.py (build_model, batches, loss_fn; optional evaluate, optimizer)")
    p.add_argument("--device", default=str(default_device()), help="where to measure (default: cuda when available, else cpu)")
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


def check_device(value: str) -> torch.device:
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


def out_dir(args: argparse.Namespace, task) -> Path:
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


def prepare_model(
    args: argparse.Namespace,
    device: torch.device,
    *,
    compiled: bool,
    check_space: Callable[[SearchSpace], object] | None = None,
):
    """model.py loaded and prepared on `device` (model_device's), the search space with --exclude applied, and the
    workload, sharded under torchrun; one line says where it runs and how (`compiled`: as the config decided).
    Refused first, before model.py is built (which may take minutes): --out naming a file, and a space file that
    `check_space` (a goal's Goal.check_space, ValueError naming the list) refuses."""
    ranks = getattr(args, "ranks", None)
    noise = getattr(args, "library_noise", None)  # None under --debug, which shows libraries' lines
    # torchao imported by model.py (through transformers, say) logs its loader's noise while model.py may be setting
    # up handlers of its own (logging.basicConfig) that LibraryNoise has not covered yet; torchao is not imported here
    failed = None
    try:  # under torchrun a rank's failure, rank 0's --out among them, is every rank's to say (agree_ready)
        if args.out and not (ranks is not None and ranks[0]):  # rank 0 writes the results: its disk is the one asked
            check_not_a_file(Path(args.out))
        space = load_space(args.space)
        if check_space is not None:
            try:
                check_space(space)
            except ValueError as exc:
                raise UserError(str(exc)) from None
        with torchao_loading_quietly() if noise is not None else contextlib.nullcontext():
            task = load_task(args.model)
        if noise is not None:  # a library model.py imported may have set up its own handler
            noise.cover()
        workload = prepare(task, device)
    except UserError as exc:
        if ranks is None:
            raise
        failed = exc
    if ranks is not None:  # every rank's checks agreed first: one that failed names itself on every rank
        agree_ready(failed, timeout_s=60 * args.rank_timeout)
    try:
        space = space.with_excludes(args.exclude or (), workload.model)
    except ValueError as exc:
        raise UserError(f"--{exc}") from None
    how = "compiled" if compiled else "eager"
    if ranks is not None:
        workload = _sharded(args, task, workload)
        how += f", sharded over {ranks[1]} ranks by {task.path.name}'s parallelize"
        space = _without_fp16(args, space)
    say(args, f"autoprec: {task.path} on {device}, {how}")
    return task, space, workload


def model_device(args: argparse.Namespace) -> torch.device:
    """--device, checked once (check_device) for everything the command does with it; under torchrun each rank's own GPU
    (cuda -> cuda:LOCAL_RANK), as torchrun's workers train."""
    device = check_device(args.device)
    ranks = getattr(args, "ranks", None)
    if ranks is None or device.index is not None or not devices.device_for(device).numbered:
        return device
    return torch.device(device.type, ranks[2])


def _without_fp16(args: argparse.Namespace, space: SearchSpace) -> SearchSpace:
    """A sharded search's space without fp16 (docs/sharded.md, "Not yet"): each rank's GradScaler decides on its own
    whether a step's gradients overflowed, so ranks skip different steps. Taken out of the default space with a line
    saying so; a space file that offers it is refused, naming its lists."""
    lists = space.loss_scaled()
    if not lists:
        return space
    if args.space is not None:
        raise UserError(
            f"{args.space}: {', '.join(lists)} offer{'s' if len(lists) == 1 else ''} fp16, which a sharded search does "
            "not search yet (each rank's GradScaler skips steps on its own: docs/sharded.md); take fp16 out of the "
            "space file and search bf16 and fp8"
        )
    say(
        args,
        "autoprec: fp16 left out of the default space: a sharded search does not search it yet (each rank's "
        "GradScaler skips steps on its own: docs/sharded.md); bf16 and fp8 are searched",
    )
    return space.without_loss_scaled()


def _sharded(args: argparse.Namespace, task, workload):
    """The workload, run on every rank of this torchrun job together (_ranks.Ranks), sharded by model.py's
    parallelize(model, mesh)."""
    if task.parallelize is None:
        raise UserError(
            f"{task.path}: torchrun started {args.ranks[1]} ranks, but the file defines no parallelize(model, mesh) to "
            "shard the model over them; define one (fully_shard each block, then the model: docs/sharded.md), or "
            "run autoprec without torchrun"
        )
    return sharded(workload, timeout_s=60 * args.rank_timeout)
