"""`import autoprec` is the runtime: torch only, silent; the tuner is autoprec.tune, reached from it on first use."""

import subprocess
import sys

import pytest


def test_importing_the_runtime_pulls_in_no_tuner_library_and_prints_nothing():
    code = (
        "import sys, autoprec\n"
        "print(sorted(m for m in ('optuna', 'pandas', 'matplotlib', 'torchao', 'yaml', 'autoprec.tune') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]" and proc.stderr == ""


def test_the_tuner_functions_do_not_shadow_their_modules():
    import importlib

    import autoprec.tune

    assert callable(autoprec.tune.search) and callable(autoprec.tune.profile) and callable(autoprec.tune.sweep)
    assert importlib.import_module("autoprec.tune._api").search is autoprec.tune.search
    assert callable(importlib.import_module("autoprec.tune._search._pipeline").search)
    assert importlib.import_module("autoprec.tune._measure._profiler").profile is autoprec.tune.profile


def test_autoprec_tune_is_reachable_from_a_plain_import_autoprec():
    code = "import autoprec\nprint(callable(autoprec.tune.search))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "True"


def test_the_runtime_serves_no_tuner_name_but_autoprec_tune():
    import autoprec

    with pytest.raises(AttributeError, match="no attribute 'search'"):  # the tuner's functions are autoprec.tune's
        autoprec.search  # noqa: B018


def test_the_tuners_api_is_its_all_and_every_stage_module_is_private():
    """What is API in autoprec.tune is `__all__` (and the export package, a seam of its own); every other module is
    private (a leading underscore), so a stage can move without breaking a user's import."""
    import pkgutil

    import autoprec.tune

    modules = {m.name for m in pkgutil.iter_modules(autoprec.tune.__path__)}
    assert {m for m in modules if not m.startswith("_")} == {"export"}
    assert len(autoprec.tune.__all__) == len(set(autoprec.tune.__all__))
    for name in autoprec.tune.__all__:
        obj = getattr(autoprec.tune, name)
        assert not name.startswith("_") and getattr(obj, "__module__", "autoprec.tune").startswith("autoprec.tune"), name
    # the seams' public faces: a goal and an export target are added through them, not through private modules
    assert {"Goal", "register_goal", "unregister_goal"} <= set(autoprec.tune.__all__)
    from autoprec.tune import export

    assert {"ExportTarget", "register_export_target", "unregister_export_target"} <= set(export.__all__)


def test_every_package_of_autoprec_is_listed_for_installation():
    """pyproject's package list is what a wheel holds: a package left out of it imports from a checkout and an
    editable install, but is missing after `pip install .` (the tuner's stage packages once were)."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "autoprec").rglob("__init__.py")}
    assert found <= listed, f"packages pyproject.toml does not install: {sorted(found - listed)}"
    assert listed - found == {"autoprec.search_spaces"}  # package data from search_spaces/, mapped in package-dir
