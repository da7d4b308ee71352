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
    assert importlib.import_module("autoprec.tune.api").search is autoprec.tune.search
    assert callable(importlib.import_module("autoprec.tune.searcher").search)
    assert importlib.import_module("autoprec.tune.profiler").profile is autoprec.tune.profile


def test_autoprec_tune_is_reachable_from_a_plain_import_autoprec():
    code = "import autoprec\nprint(callable(autoprec.tune.search))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "True"


def test_the_runtime_serves_no_tuner_name_but_autoprec_tune():
    import autoprec

    with pytest.raises(AttributeError, match="no attribute 'search'"):  # the tuner's functions are autoprec.tune's
        autoprec.search  # noqa: B018
