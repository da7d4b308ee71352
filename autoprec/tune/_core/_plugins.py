"""Plugins for the command line: modules that register goals, targets, export targets, devices or format families
from outside autoprec, imported before the parser is built so that --objective, --target and --to offer what they
register. Two sources: every installed package's entry point in the `autoprec.plugins` group, then each
`--plugin MODULE_OR_FILE` (a module's dotted name, or a Python file's path), in the order given.

Importing a plugin runs its code: it is code the user chose to run (installed, or named on the command line), as
model.py is. A plugin already imported is not imported again (main() may run twice in one process).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from autoprec.errors import UserError, describe

GROUP = "autoprec.plugins"  # the entry-point group an installed package names its plugin module in
# The entry points loaded in this process: a module is imported once by Python, but one naming a function would
# register its names again on a second main() and be refused as already registered.
_CALLED: set[str] = set()


def load_plugins(given: Sequence[str]) -> None:
    """Import the installed entry points of GROUP, then each of `given` (a module name, or a path ending in .py or
    naming a file); UserError naming the plugin, what failed and the fix."""
    for entry in importlib.metadata.entry_points(group=GROUP):
        if entry.value in _CALLED:
            continue
        try:
            loaded = entry.load()
            if callable(loaded) and not isinstance(loaded, type):  # an entry point may name a function that registers
                loaded()
        except (Exception, SystemExit) as exc:
            where = f" (installed by {entry.dist.name})" if entry.dist is not None else ""
            raise UserError(
                f"plugin entry point {entry.name} = {entry.value}{where}, group {GROUP}: loading it failed: "
                f"{describe(exc)}; fix it or uninstall the package"
            ) from exc
        _CALLED.add(entry.value)
    for plugin in given:
        load_plugin(plugin)


def load_plugin(plugin: str) -> None:
    """Import one plugin: a Python file (a path ending in .py, or one that exists) or a module's dotted name."""
    path = Path(plugin)
    if plugin.endswith(".py") or path.is_file():
        _load_file(plugin, path)
        return
    try:
        importlib.import_module(plugin)
    except (Exception, SystemExit) as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None and plugin.startswith(exc.name)
        fix = "give a module importable here (installed, or on PYTHONPATH) or a .py file's path" if missing else "fix it"
        raise UserError(f"--plugin {plugin}: importing it failed: {describe(exc)}; {fix}") from exc


def _load_file(plugin: str, path: Path) -> None:
    if not path.is_file():
        raise UserError(f"--plugin {plugin}: no such file; give a .py file's path or a module's dotted name")
    resolved = path.resolve()
    # one module per file, named by its path: imported once however often main() runs in this process
    name = f"_autoprec_plugin_{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise UserError(f"--plugin {plugin}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: a dataclass or a pickle in it looks its module up by name
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(name, None)
        raise UserError(f"--plugin {plugin}: importing it failed: {describe(exc)}; fix it") from exc
