"""A policy with phases (a schedule) exported: one file per phase, each written by the target as a policy of its own
(`Policy.in_phase`), and a manifest beside them, `<name>_schedule.json`, that lists each phase's file and where it
starts, with how the target's framework switches (`ExportTarget.switch`). `autoprec verify` reads the manifest to
check each phase's file against its phase.

The frameworks apply one configuration per run, or per forward (Transformer Engine's recipe): what the schedule asks
of them is said, in the manifest and the export's lines, never left implicit. The manifest is data (JSON): nothing in
it is run, and the names in it are the files the export wrote beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autoprec.errors import UserError, printable
from autoprec.files import read_json, write_text
from autoprec.policy import START_STEP_RULE, Policy
from autoprec.tune.export.base import ExportTarget


def manifest_path(out: Path) -> Path:
    """The schedule's manifest beside the first phase's file: <name>_schedule.json."""
    return out.with_name(f"{out.stem}_schedule.json")


def phase_paths(out: Path, phases: int) -> list[Path]:
    """Each phase's file: the first at `out` (what a run without the schedule would load), then <name>_phase<i>."""
    return [out, *(out.with_name(f"{out.stem}_phase{i}{out.suffix}") for i in range(1, phases + 1))]


def _ours(path: Path) -> bool:
    """Whether `path` is a file an `autoprec export` wrote (its first lines name the command), never read past 4 KiB."""
    try:
        with open(path, "rb") as f:
            return b"autoprec export --to " in f.read(4096)
    except OSError:
        return False


def _refuse_theirs(paths: list[Path], source: str) -> None:
    """The files a schedule's export writes besides --out (the other phases' files, the list) are named from --out,
    not given: refuse one that is the policy itself, or a file autoprec did not write, rather than replace it."""
    for path in paths:
        if not (path.exists() or path.is_symlink()):
            continue
        if Path(source).exists() and path.resolve() == Path(source).resolve():
            raise UserError(
                f"{printable(str(path))}: the export of the schedule writes one of its files there, and it is the policy "
                "file itself; give --out another name"
            )
        if not _ours(path):
            raise UserError(
                f"{printable(str(path))}: exists and autoprec did not write it; the export of a schedule writes a phase's "
                f"file or the list of them there (named from --out): move it, or give --out another name"
            )


def write_schedule(chosen: ExportTarget, policy: Policy, out: Path, *, source: str, **given: Any) -> list[str]:
    """Each phase's file and the manifest; returns the phases' lines (what each cannot express, "phase i: ..."; each
    requirement once) and, as a note, the files and how to switch. Refuses, before writing, to replace the policy
    or a file autoprec did not write with a file whose name comes from --out."""
    paths = phase_paths(out, len(policy.phases))
    _refuse_theirs([*paths[1:], manifest_path(out)], source)
    lines: list[str] = []
    for index, path in enumerate(paths):
        for line in chosen.write(policy.in_phase(index), path, source=f"{source}, phase {index} of its schedule", **given):
            said = line if line.startswith("note: ") else f"phase {index}: {line}"
            if said not in lines:
                lines.append(said)
    starts = [0.0, *(phase.from_fraction for phase in policy.phases)]
    manifest = {
        "written_by": f"autoprec export --to {chosen.name}",  # what _ours finds in the first lines
        "policy": source,
        "start_step": START_STEP_RULE,
        "switch": chosen.switch,
        "phases": [
            {
                "phase": i,
                "from_fraction": start,
                "file": path.name,
                "changes": policy.phases[i - 1].to_dict()["layers"] if i else None,
            }
            for i, (start, path) in enumerate(zip(starts, paths))
        ],
    }
    write_text(manifest_path(out), json.dumps(manifest, indent=2, allow_nan=False) + "\n")
    files = ", ".join(f"{p.name} from {start:g} of the run" for p, start in zip(paths, starts))
    lines.append(
        f"note: a schedule of {len(paths)} phases, one file each ({files}; listed in {manifest_path(out).name}); the "
        f"framework applies one at a time: {chosen.switch}"
    )
    return lines


def forget_schedule(out: Path) -> list[str]:
    """A policy without phases written over an earlier schedule's first file: its list is removed (verify would read
    the other phases' files as this policy's), and said; the old phases' files are left, named."""
    path = manifest_path(out)
    if not path.is_file() or path.is_symlink() or not _ours(path):  # a file of the user's by that name stays
        return []
    path.unlink()
    return [
        f"note: removed {path.name}, an earlier export's list of a schedule's phases (this policy has none); its phase "
        f"files ({out.stem}_phase1{out.suffix}, ...) are left as they were"
    ]


def read_schedule(exported: Path, policy: Policy) -> list[tuple[int, float, Path]]:
    """(phase, from_fraction, file) for each phase of `policy`, from the manifest beside `exported` (the first phase's
    file); UserError where it is missing or does not list the policy's phases, naming what differs."""
    path = manifest_path(exported)
    if not path.is_file():
        raise UserError(
            f"{printable(str(exported))}: the policy has a schedule ({len(policy.phases) + 1} phases), but no "
            f"{printable(path.name)} lists the phases' files beside it: export the policy again (autoprec export writes "
            "one file per phase and that list)"
        )
    data = read_json(path)
    phases = data.get("phases") if isinstance(data, dict) else None
    starts = [0.0, *(phase.from_fraction for phase in policy.phases)]
    if not isinstance(phases, list) or [p.get("from_fraction") if isinstance(p, dict) else None for p in phases] != starts:
        found = [p.get("from_fraction") for p in phases if isinstance(p, dict)] if isinstance(phases, list) else "none"
        raise UserError(
            f"{printable(str(path))}: its phases start at {printable(str(found))}, the policy's at {starts}: it was "
            "exported from another policy; export this one again"
        )
    out = []
    for index, (entry, start) in enumerate(zip(phases, starts)):
        name = entry.get("file")
        # a file beside the manifest, by its bare name
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise UserError(
                f"{printable(str(path))}: phase {index}'s file must be a file name beside it, got {printable(repr(name))}"
            )
        out.append((index, start, path.with_name(name)))
    if out[0][2].name != exported.name:  # the file the user named is the one checked as the first phase
        raise UserError(
            f"{printable(str(path))}: its first phase is {printable(out[0][2].name)}, not {printable(exported.name)}: "
            "verify the first phase's file, or export the policy again"
        )
    return out
