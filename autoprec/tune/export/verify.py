"""`autoprec verify`: what each linear of a model runs in under an exported file, by the target framework's own
matching rules, against what the policy says, per GEMM (fprop, dgrad, wgrad), and whether FSDP2 all-gathers its
weight in fp8 (the policy's fsdp_fp8_all_gather).

The verifier asks the file's target (ExportTarget.resolve, found from the "autoprec export --to NAME" line every
exported file holds, or given) and compares; it knows no target by name. Nothing in the file is run: each target
reads its file as data (ast, JSON, YAML). It also checks the process's environment against the one the file records
(ExportTarget.environment: Transformer Engine's NVTE_* variables), a failed check per variable that differs.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

from autoprec.errors import UserError, printable
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune.export._common import environment_mismatches, layer_only, policy_gemms, read_regular, regular_file
from autoprec.tune.export._schedule import read_schedule
from autoprec.tune.export.base import HIGH, ExportTarget, Gemms, Resolved, export_target_named

_WRITTEN_BY = re.compile(r"autoprec export --to ([a-z0-9][a-z0-9_-]*)")  # in every exported file's first lines


@dataclasses.dataclass(frozen=True)
class Row:
    """One linear: the policy's format for it ("" where the policy leaves it to the model's dtype), its GEMMs under
    the policy, whether the policy all-gathers its weight in fp8 under FSDP2, and what the framework runs it in
    under the file. `close`: None for a linear of the model; for a file's entry that names none (a mistyped name,
    which selects nothing), the model's linears it resembles, and the row never matches."""

    layer: str
    policy_format: str
    expected: Gemms
    resolved: Resolved
    expected_fp8_all_gather: bool = False
    close: tuple[str, ...] | None = None

    @property
    def ok(self) -> bool:
        return (
            self.close is None
            and self.resolved.gemms == self.expected
            and self.resolved.fp8_all_gather == self.expected_fp8_all_gather
        )


@dataclasses.dataclass(frozen=True)
class Verification:
    """The rows, and the environment check: what the file records of its framework's environment (variable -> the
    value it must read, None: unset) and one line per variable the process gives another value."""

    target: str
    rows: tuple[Row, ...]
    environment: dict[str, str | None] = dataclasses.field(default_factory=dict)
    environment_mismatches: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Every linear runs as the policy says, the file names none the model lacks, and the environment matches."""
        return not self.differing and not self.environment_mismatches

    @property
    def differing(self) -> list[str]:
        """The linears that run otherwise than the policy says, then the file's entries that name no linear."""
        return [row.layer for row in self.rows if not row.ok]

    @property
    def unknown(self) -> list[Row]:
        """The rows of the file's entries that name no linear of the model."""
        return [row for row in self.rows if row.close is not None]

    def to_dict(self) -> dict[str, object]:
        return {
            "target": self.target,
            "matches": self.ok,
            "differing": self.differing,
            "environment": {"expected": dict(self.environment), "mismatches": list(self.environment_mismatches)},
            "unknown": [{"entry": r.layer, "close_matches": list(r.close or ())} for r in self.unknown],
            "layers": [
                {
                    "layer": r.layer,
                    "policy": r.policy_format or None,
                    "expected": list(r.expected),
                    "resolved": None if r.resolved.gemms is None else list(r.resolved.gemms),
                    "expected_fp8_all_gather": r.expected_fp8_all_gather,
                    "resolved_fp8_all_gather": r.resolved.fp8_all_gather,
                    "via": r.resolved.via,
                    "ok": r.ok,
                }
                for r in self.rows
            ],
        }


def written_by(exported: Path) -> str | None:
    """The target that wrote `exported`, from its "autoprec export --to NAME" line; None when none is there."""
    head = read_regular(exported, limit=4096).decode("utf-8", errors="replace")  # never waits on a FIFO
    found = _WRITTEN_BY.search(head)
    return None if found is None else found[1]


def linear_names(model: str | Path, *, flag: str = "--model") -> list[str]:
    """The module paths of a model's linears (every torch.nn.Linear, subclasses too), from a model.py's
    build_model(), or read from a text file of module paths, one a line ('#' starts a comment). `flag`: the option
    that named `model`, for the error."""
    path = Path(model)
    fix = f"give {flag} a model.py or a text file of module names"
    try:
        data = read_regular(path, fix, limit=0 if path.suffix == ".py" else -1)  # a FIFO would hang the read or import
    except UserError as exc:
        raise UserError(f"{flag} {exc}") from None
    if path.suffix != ".py":
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise UserError(f"{flag} {path}: cannot read it as a list of module names ({exc})") from None
        names = [line.split("#", 1)[0].strip() for line in lines]
        return [n for n in names if n]
    import torch

    from autoprec.tune._measure._task import load_task, meta_model

    built = meta_model(load_task(path), verb="verify")  # names only: a model file that trains its model never does here
    return [name for name, m in built.named_modules() if isinstance(m, torch.nn.Linear)]


def verify(
    exported: str | Path,
    policy: Policy,
    module_names: list[str],
    target: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Verification:
    """Resolve `exported` on `module_names` (a model's linears) with its target's rules and compare each linear
    with `policy`; then a row for each entry of the file that names no linear (Row.close); then `environ` (default:
    this process's environment) against the environment the file records. A layer the policy keeps
    in fp32 inside a bf16/fp16 root is expected in fp32, and where the file gives it no recipe (HIGH: the model's
    dtype) it runs in the root's. UserError for a path that is not a regular file, for a policy layer in a quantized
    format that is no linear of the model (the policy was searched on another model) and for a file its target
    cannot read."""
    if policy.phases:
        raise ValueError("verify() checks one phase's file against one phase: use verify_phases for a schedule")
    exported = regular_file(exported)
    wrote = written_by(exported)
    name = target or wrote
    if name is None:
        raise UserError(f"{exported}: no 'autoprec export --to NAME' line in it: give --to, or verify a file autoprec exported")
    if wrote is not None and wrote != name:  # its own reader would misread it (a Python file read as JSON)
        raise UserError(
            f"{exported}: written by 'autoprec export --to {printable(wrote)}', not --to {printable(name)}: leave "
            f"--to out (the file names its target) or give --to {printable(wrote)}"
        )
    try:
        chosen = export_target_named(name)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if not module_names:
        raise UserError("the model has no torch.nn.Linear layers: nothing to verify")
    known = set(module_names)
    missing = [n for n, f in policy.layers.items() if n != ROOT and layer_only(f) and n not in known]
    if missing:
        shown_names = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise UserError(
            f"the policy's quantized layers {printable(shown_names)} are not linears of this model: it was searched "
            "on another model (or give the model it was searched on)"
        )
    resolved = chosen.resolve(exported, list(module_names))
    root = policy.layers.get(ROOT)
    rows = []
    for layer in module_names:
        fmt = policy.layers.get(layer) if layer != ROOT else None
        found = resolved.get(layer) or Resolved(None, f"--to {chosen.name}'s resolve() gave nothing for it")
        expected = policy_gemms(fmt) if fmt else HIGH
        if fmt is Format.FP32 and root in (Format.BF16, Format.FP16):
            # The policy keeps it in fp32 inside a lowered model, which no file's recipe says: every framework runs a
            # module it has no recipe for in the model's dtype (autocast's), as the export said when it wrote the file.
            expected = ("fp32", "fp32", "fp32")
            if found.gemms == HIGH:
                dtype = root.value
                found = dataclasses.replace(
                    found, gemms=(dtype, dtype, dtype), via=f"{found.via}; in the model's dtype, {dtype} under the policy's root"
                )
        rows.append(Row(layer, fmt.value if fmt else "", expected, found, fmt in policy.fp8_all_gathered))
    for entry, found in resolved.items():  # what the file names that the model does not have: it selects nothing
        if entry not in known:
            close = tuple(difflib.get_close_matches(entry[:200], module_names, n=3))  # a long entry: its start
            fmt = policy.layers.get(entry)
            found = dataclasses.replace(found, via=f"{found.via}; names no linear of the model")
            rows.append(Row(entry, fmt.value if fmt else "", HIGH, found, close=close))
    recorded = chosen.environment(exported)
    needed = _needed_environment(chosen, policy, exported.suffix)
    mismatches = []
    if needed != recorded:  # the file's own record was edited: what the policy's recipes need is checked, not it
        mismatches.append(
            f"the file records the environment {printable(str(recorded))[:200]}, but this policy's export records "
            f"{printable(str(needed))[:200]}: the file's record was edited, or it was exported from another policy; "
            "export it again"
        )
    mismatches += environment_mismatches(needed, os.environ if environ is None else environ)
    return Verification(chosen.name, tuple(rows), recorded, tuple(mismatches))


def _needed_environment(chosen: ExportTarget, policy: Policy, suffix: str) -> dict[str, str | None]:
    """The environment the target records for `policy`'s recipes: the policy exported afresh (into a folder of its
    own, removed after) and its record read back, so the expectation is the target's own, not the checked file's."""
    with tempfile.TemporaryDirectory() as folder:
        fresh = Path(folder) / f"policy{suffix}"
        chosen.write(policy, fresh, source="autoprec verify")
        return chosen.environment(fresh)


def verify_phases(
    exported: str | Path, policy: Policy, module_names: list[str], target: str | None = None
) -> list[tuple[str, Verification]]:
    """verify() for each phase of `policy`: (heading, verification) for each phase's file, as the manifest beside
    `exported` (the first phase's file) lists them; a policy without phases: one, with no heading."""
    if not policy.phases:
        return [("", verify(exported, policy, module_names, target))]
    return [
        (
            f"phase {index} (from {start:g} of the run): {printable(str(path))}",
            verify(path, policy.in_phase(index), module_names, target),
        )
        for index, start, path in read_schedule(regular_file(exported), policy)
    ]


def _gemms(gemms: Gemms | None, gather: bool = False) -> str:
    if gemms is None:  # the framework refuses the file there, or the file says two things of it
        return "unresolved"
    return " / ".join(g or "high" for g in gemms) + (", fp8 all-gather" if gather else "")


def _cut(layer: str) -> str:
    """A file's entry cut to 80 characters for printing: an entry can be any length."""
    return layer if len(layer) <= 80 else f"{layer[:80]}... ({len(layer)} characters)"


def shown_entry(layer: str) -> str:
    """A file's entry as every message prints it: cut to 80 characters, its control characters escaped."""
    return printable(_cut(layer))


def table(result: Verification) -> str:
    """The table `autoprec verify` prints: one linear a line, the policy's GEMMs, the file's, and how the framework
    decided; names escaped (errors.printable)."""
    head = ("layer", "policy", "policy: fprop / dgrad / wgrad", f"{result.target}: fprop / dgrad / wgrad", "", "via")
    cells = [
        (
            shown_entry(r.layer) or "(root)",
            r.policy_format or "-",
            _gemms(r.expected, r.expected_fp8_all_gather),
            _gemms(r.resolved.gemms, r.resolved.fp8_all_gather),
            "ok" if r.ok else "DIFFERS",
            printable(r.resolved.via),
        )
        for r in result.rows
    ]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *cells]]
    linears = [r for r in result.rows if r.close is None]
    differing = [r.layer for r in linears if not r.ok]
    if differing:
        names = ", ".join(shown_entry(n) for n in differing)
        summary = f"{len(differing)} of {len(linears)} linears differ from the policy: {names}"
    else:
        summary = f"all {len(linears)} linears run as the policy says"
    if unknown := result.unknown:
        entries = ", ".join(
            printable(repr(_cut(r.layer))) + (f" (close: {printable(', '.join(map(repr, r.close)))})" if r.close else "")
            for r in unknown
        )
        layers = "a layer" if len(unknown) == 1 else f"{len(unknown)} layers"
        summary += f"{'; and' if differing else ', but'} the file names {layers} the model does not have: {entries}"
    lines.append(summary)
    if result.environment_mismatches:  # one line each: the variable, its value here, the value the file records
        lines += [f"environment differs: {line}" for line in result.environment_mismatches]
    elif result.environment:
        lines.append(f"environment: as the file records ({', '.join(map(printable, result.environment))})")
    return "\n".join(lines)
