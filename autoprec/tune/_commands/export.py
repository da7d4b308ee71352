"""`autoprec export` and `autoprec verify`: a policy written for another training tool (every registered export
target, with the options it adds), and the check that such a file runs each linear as the policy says."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from autoprec.errors import UserError, printable
from autoprec.policy import Policy, load_policy
from autoprec.tune._commands._shared import Verb, print_json
from autoprec.tune._core._records import Measured
from autoprec.tune._report._show import coverage_line
from autoprec.tune.export import ExportTarget, default_path, export, export_targets, options
from autoprec.tune.export._common import regular_file
from autoprec.tune.export.verify import Verification, linear_names, shown_entry, table, verify_phases


def _export_arguments(p: argparse.ArgumentParser) -> None:
    # every registered target (autoprec.tune.export): its name, its file's suffix and the options it adds
    p.add_argument("policy", help="path to a policy.json")
    p.add_argument(
        "--to",
        required=True,
        choices=[t.name for t in export_targets()],
        help="; ".join(f"{t.name}: {t.summary}" for t in export_targets()),
    )
    p.add_argument("--out", help=f"the file to write (default: beside the policy, {_export_file_names(export_targets())})")
    for option, names in options().items():
        p.add_argument(
            option.flag, dest=option.dest, type=option.type, metavar=option.metavar, help=f"{', '.join(names)}: {option.help}"
        )
    p.add_argument("--check", metavar="MODEL", help="then verify the file on MODEL's linears (as `autoprec verify`)")


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("exported", help="a file `autoprec export` wrote")
    p.add_argument("--policy", required=True, help="the policy.json it was exported from")
    p.add_argument("--model", required=True, help="the model.py (its build_model()'s linears), or a text file of module names")
    p.add_argument("--to", choices=[t.name for t in export_targets()], help="the file's target (default: the one it names)")


def _export_file_names(targets: Sequence[ExportTarget]) -> str:
    """'<name>_<target>.py, or .json for megatron': the suffix most targets write, then the others'."""
    suffixes = [t.suffix for t in targets]
    usual = max(suffixes, key=suffixes.count)
    others = [f"{t.suffix} for {t.name}" for t in targets if t.suffix != usual]
    return f"<name>_<target>{usual}" + (f", or {', '.join(others)}" if others else "")


def searched_policy(path: str) -> Policy:
    """The policy file, refused in one line if it is not a regular file (reading a FIFO waits for a writer)."""
    return load_policy(regular_file(path, "give the policy.json a search wrote"))


def cmd_export(args: argparse.Namespace) -> int:
    policy = searched_policy(args.policy)
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
    if not args.json:  # what the file leaves out is never dropped silently: under --quiet a warning, on stderr
        for line in left_out:  # a "note: " line is what the file needs (a framework's version, its environment)
            said = printable(line) if line.startswith("note: ") else f"not expressed: {printable(line)}"
            print(said, file=sys.stderr if args.quiet else sys.stdout)
    if not args.check:  # with --check, said under verify's table
        _say_outside(args, policy)
    checked = _verified(args, out, policy, args.check, args.to, flag="--check") if args.check else None
    if args.json:
        print_json(args, {"file": str(out), "not_expressed": left_out, **({"check": _as_json(checked)} if checked else {})})
    return _verify_code(checked)


def _verified(
    args: argparse.Namespace, exported: Path, policy, model: str, target: str | None, *, flag: str = "--model"
) -> list[tuple[str, Verification]]:
    """The verification of `exported` on `model`'s linears (autoprec verify), each phase's of a schedule, its tables
    printed unless --json or --quiet (a schedule's under each phase's heading); `flag` named `model`."""
    results = verify_phases(exported, policy, linear_names(model, flag=flag), target)
    if not (args.json or args.quiet):
        for heading, result in results:
            if heading:
                print(f"\n{heading}")
            print(table(result))
        _say_outside(args, policy)
    return results


def _as_json(results: list[tuple[str, Verification]]) -> dict:
    """One verification's record; a schedule's as {"matches", "phases": [each phase's, with its heading]}."""
    if len(results) == 1 and not results[0][0]:
        return results[0][1].to_dict()
    return {"matches": all(r.ok for _, r in results), "phases": [{"phase": h, **r.to_dict()} for h, r in results]}


def _say_outside(args: argparse.Namespace, policy: Policy) -> None:
    """What the policy's search left in the model root's format (measured.coverage: a MoE's fused experts), where that
    is much of the step: "all 9 linears" is not the model."""
    line = coverage_line(Measured.of(policy))
    if line and not (args.json or args.quiet):
        print(printable(line))


def _verify_code(results: list[tuple[str, Verification]] | None) -> int:
    """1 when a linear runs otherwise than the policy says under an exported file (a schedule's: any phase's), or the
    environment differs from the one the file records, naming them on stderr."""
    if results is None or all(result.ok for _, result in results):
        return 0
    for heading, result in results:
        where = f" in {heading.split(' (')[0]}" if heading else ""  # "phase 1"
        if result.differing:
            names = ", ".join(shown_entry(n) for n in result.differing)
            print(f"autoprec: the export differs from the policy at {names}{where}", file=sys.stderr)
        for line in result.environment_mismatches:
            print(f"autoprec: the environment differs from the export's: {line}{where}", file=sys.stderr)
    return 1


def cmd_verify(args: argparse.Namespace) -> int:
    results = _verified(args, Path(args.exported), searched_policy(args.policy), args.model, args.to)
    if args.json:
        print_json(args, _as_json(results))
    return _verify_code(results)


EXPORT = Verb(
    "export",
    "write a policy's fp8 layers for another training tool",
    _export_arguments,
    cmd_export,
    description="write a policy's fp8 layers for another training tool; what it cannot express is listed",
)
_VERIFY = "check that an exported file runs each linear of a model as the policy says, per GEMM, by the framework's rules"
VERIFY = Verb("verify", _VERIFY, _verify_arguments, cmd_verify, description=f"{_VERIFY}; exit 1 naming each linear that differs")
