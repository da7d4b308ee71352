"""`autoprec verify`: what each linear of a model runs in under an exported file, by the target framework's own
matching rules, against what the policy says, per GEMM (fprop, dgrad, wgrad), and whether FSDP2 all-gathers its
weight in fp8 (the policy's fsdp_fp8_all_gather).

The verifier asks the file's target (ExportTarget.resolve, found from the "autoprec export --to NAME" line every
exported file holds, or given) and compares; it knows no target by name. Nothing in the file is run: each target
reads its file as data (ast, JSON, YAML).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from autoprec.errors import UserError, printable
from autoprec.policy import ROOT, Policy
from autoprec.tune.export._common import layer_only, policy_gemms
from autoprec.tune.export.base import HIGH, Gemms, Resolved, export_target_named

_WRITTEN_BY = re.compile(r"autoprec export --to ([a-z0-9][a-z0-9_-]*)")  # in every exported file's first lines


@dataclasses.dataclass(frozen=True)
class Row:
    """One linear: the policy's format for it ("" where the policy leaves it to the model's dtype), its GEMMs under
    the policy, whether the policy all-gathers its weight in fp8 under FSDP2, and what the framework runs it in
    under the file."""

    layer: str
    policy_format: str
    expected: Gemms
    resolved: Resolved
    expected_fp8_all_gather: bool = False

    @property
    def ok(self) -> bool:
        return self.resolved.gemms == self.expected and self.resolved.fp8_all_gather == self.expected_fp8_all_gather


@dataclasses.dataclass(frozen=True)
class Verification:
    target: str
    rows: tuple[Row, ...]

    @property
    def differing(self) -> list[str]:
        return [row.layer for row in self.rows if not row.ok]

    def to_dict(self) -> dict[str, object]:
        return {
            "target": self.target,
            "matches": not self.differing,
            "differing": self.differing,
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
    try:
        with open(exported, encoding="utf-8", errors="replace") as f:
            head = f.read(4096)
    except OSError as exc:
        raise UserError(f"{exported}: cannot read it ({exc.strerror or exc})") from None
    found = _WRITTEN_BY.search(head)
    return None if found is None else found[1]


def linear_names(model: str | Path, *, flag: str = "--model") -> list[str]:
    """The module paths of a model's linears (every torch.nn.Linear, subclasses too), from a model.py's
    build_model(), or read from a text file of module paths, one a line ('#' starts a comment). `flag`: the option
    that named `model`, for the error."""
    path = Path(model)
    if path.suffix != ".py":
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"{flag} {path}: cannot read it as a list of module names ({exc})") from None
        names = [line.split("#", 1)[0].strip() for line in lines]
        return [n for n in names if n]
    import torch

    from autoprec.tune._measure._task import load_task, meta_model

    built = meta_model(load_task(path), verb="verify")  # names only: a model file that trains its model never does here
    return [name for name, m in built.named_modules() if isinstance(m, torch.nn.Linear)]


def verify(exported: str | Path, policy: Policy, module_names: list[str], target: str | None = None) -> Verification:
    """Resolve `exported` on `module_names` (a model's linears) with its target's rules and compare each linear
    with `policy`. UserError for a policy layer in a quantized format that is no linear of the model (the policy
    was searched on another model) and for a file its target cannot read."""
    exported = Path(exported)
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
    rows = []
    for layer in module_names:
        fmt = policy.layers.get(layer) if layer != ROOT else None
        found = resolved.get(layer) or Resolved(None, f"--to {chosen.name}'s resolve() gave nothing for it")
        gather = fmt in policy.fp8_all_gathered
        rows.append(Row(layer, fmt.value if fmt else "", policy_gemms(fmt) if fmt else HIGH, found, gather))
    return Verification(chosen.name, tuple(rows))


def _gemms(gemms: Gemms | None, gather: bool = False) -> str:
    if gemms is None:
        return "refused"
    return " / ".join(g or "high" for g in gemms) + (", fp8 all-gather" if gather else "")


def table(result: Verification) -> str:
    """The table `autoprec verify` prints: one linear a line, the policy's GEMMs, the file's, and how the framework
    decided; names escaped (errors.printable)."""
    head = ("layer", "policy", "policy: fprop / dgrad / wgrad", f"{result.target}: fprop / dgrad / wgrad", "", "via")
    cells = [
        (
            printable(r.layer) or "(root)",
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
    differing = result.differing
    if differing:
        names = ", ".join(printable(n) for n in differing)
        lines.append(f"{len(differing)} of {len(result.rows)} linears differ from the policy: {names}")
    else:
        lines.append(f"all {len(result.rows)} linears run as the policy says")
    return "\n".join(lines)
