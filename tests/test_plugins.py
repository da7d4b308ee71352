"""autoprec/tune/_core/_plugins.py: `autoprec --plugin MODULE_OR_FILE` and the `autoprec.plugins` entry points register goals,
targets and export targets before the parser is built, so --objective, --target and --to offer them."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest

from autoprec import Policy
from autoprec.tune._cli import main
from autoprec.tune._core import _plugins as plugins

PLUGIN = """
from autoprec.tune import Goal, Target, register_goal, register_target
from autoprec.tune._decide._choose import choose
from autoprec.tune.export import ExportTarget, register_export_target


@register_goal
class Fewest(Goal):
    name = "{prefix}-fewest"
    label = "{prefix} lowered layers"
    direction = "minimize"
    summary = "the fewest lowered layers"

    def value(self, record, policy):
        return float(len(policy.layers))

    def choose(self, finals, candidates, alternatives=()):
        return choose(finals, candidates, alternatives)


register_target(Target(name="{prefix}-gpu", device="a toy GPU", tflops={{"fp32": 1.0, "bf16": 2.0}}, source="made up", bandwidth_tbs=1.0))


@register_export_target
class Lines(ExportTarget):
    name = "{prefix}-lines"
    suffix = ".txt"
    summary = "one line per layer"

    def write(self, policy, out, *, source="a policy", **options):
        out.write_text("".join(f"{{n}} {{f.value}}\\n" for n, f in policy.layers.items()), encoding="utf-8")
        return []
"""


@pytest.fixture
def unregistered():
    """What a test's plugin registers under `prefix`, gone after it, and its module forgotten (imported again)."""
    from autoprec.tune import unregister_goal, unregister_target
    from autoprec.tune.export import unregister_export_target

    before = set(sys.modules)
    yield "toyplug"
    for undo, name in (
        (unregister_goal, "toyplug-fewest"),
        (unregister_target, "toyplug-gpu"),
        (unregister_export_target, "toyplug-lines"),
    ):
        try:
            undo(name)
        except KeyError:
            pass
    for name in set(sys.modules) - before:
        if "plugin" in name or name.startswith("toyplug"):
            del sys.modules[name]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_plugin_file_given_before_the_verb_offers_its_export_target_goal_and_target(tmp_path, capsys, unregistered):
    plugin = tmp_path / "myplugin.py"
    plugin.write_text(PLUGIN.format(prefix=unregistered), encoding="utf-8")
    Policy(layers={"a": "bf16", "b": "fp32"}).save(tmp_path / "policy.json")
    code, out, err = run(capsys, "--plugin", plugin, "export", tmp_path / "policy.json", "--to", "toyplug-lines")
    assert code == 0, err
    assert (tmp_path / "policy_toyplug-lines.txt").read_text().splitlines() == ["a bf16", "b fp32"]
    # a goal and a target: accepted by search's options and by the goal's check of the space (a space of formats the
    # toy target runs), which come before model.py is read (here, none)
    model = tmp_path / "nope.py"
    space = tmp_path / "space.yaml"
    space.write_text("default: [fp32, bf16]\nlayers: {Linear: [fp32, bf16]}\n", encoding="utf-8")
    for extra in (("--objective", "toyplug-fewest"), ("--objective", "flops", "--target", "toyplug-gpu")):
        code, _, err = run(
            capsys, f"--plugin={plugin}", "search", model, "--budget", "0.1", "--device", "cpu", "--space", space, *extra
        )
        assert code == 2 and err.strip().splitlines()[-1] == f"autoprec: error: {model}: no such file", err
    # given twice in one process (main() runs again): imported once, nothing registered twice
    code, _, err = run(
        capsys, "--plugin", plugin, "--plugin", plugin, "export", tmp_path / "policy.json", "--to", "toyplug-lines"
    )
    assert code == 0, err


def test_a_plugin_module_by_name_and_an_installed_entry_point_are_loaded(tmp_path, capsys, monkeypatch, unregistered):
    (tmp_path / "toyplug_mod.py").write_text(PLUGIN.format(prefix=unregistered), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    Policy(layers={"a": "bf16"}).save(tmp_path / "policy.json")
    code, _, err = run(capsys, "--plugin", "toyplug_mod", "export", tmp_path / "policy.json", "--to", "toyplug-lines")
    assert code == 0, err
    from autoprec.tune import unregister_goal, unregister_target
    from autoprec.tune.export import unregister_export_target

    del sys.modules["toyplug_mod"]  # as in a fresh process: nothing of it imported or registered
    unregister_goal("toyplug-fewest"), unregister_target("toyplug-gpu"), unregister_export_target("toyplug-lines")
    entry = importlib.metadata.EntryPoint(name="toy", value="toyplug_mod", group=plugins.GROUP)
    monkeypatch.setattr(plugins, "_CALLED", set())
    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", lambda group: [entry] if group == plugins.GROUP else [])
    code, _, err = run(capsys, "export", tmp_path / "policy.json", "--to", "toyplug-lines")  # no --plugin: installed
    assert code == 0, err


@pytest.mark.parametrize(
    ("given", "source", "expected"),
    [
        ("missing.py", None, "--plugin {dir}/missing.py: no such file; give a .py file's path or a module's dotted name"),
        ("no_such_module_here", None, "--plugin no_such_module_here: importing it failed: ModuleNotFoundError: No module "
         "named 'no_such_module_here'; give a module importable here (installed, or on PYTHONPATH) or a .py file's path"),
        ("broken.py", "raise RuntimeError('half done')\n", "--plugin {dir}/broken.py: importing it failed: "
         "RuntimeError: half done; fix it"),
        ("exits.py", "import sys\nsys.exit(3)\n", "--plugin {dir}/exits.py: importing it failed: SystemExit: 3; fix it"),
    ],
)  # fmt: skip
def test_a_plugin_that_cannot_be_imported_is_one_line_and_exit_2(tmp_path, capsys, given, source, expected):
    if source is not None:
        (tmp_path / given).write_text(source, encoding="utf-8")
    name = str(tmp_path / given) if given.endswith(".py") else given
    code, out, err = run(capsys, "--plugin", name, "show", tmp_path / "policy.json")
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.strip().splitlines() == [f"autoprec: error: {expected.format(dir=tmp_path)}"]


def test_an_entry_point_that_fails_names_itself_its_group_and_the_fix(capsys, monkeypatch):
    entry = importlib.metadata.EntryPoint(name="bad", value="no_such_plugin_pkg.mod", group=plugins.GROUP)
    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", lambda group: [entry])
    code, _, err = run(capsys, "show", "p.json")
    assert code == 2 and err.strip() == (
        "autoprec: error: plugin entry point bad = no_such_plugin_pkg.mod, group autoprec.plugins: loading it failed: "
        "ModuleNotFoundError: No module named 'no_such_plugin_pkg'; fix it or uninstall the package"
    )


def test_an_entry_point_naming_a_function_runs_once_per_process_and_its_failure_is_one_line(tmp_path, capsys, monkeypatch):
    """A function entry point that registers a target: a second main() in one process does not register it again
    (that was a traceback: already registered), and one that raises is one line, exit 2."""
    from autoprec.tune import Target, register_target, unregister_target

    calls = []
    module = types.ModuleType("toyplug_fn")
    module.register = lambda: calls.append(
        register_target(Target("toyplug-fn-gpu", "a toy", {"bf16": 1.0, "fp32": 0.5}, "test", 1.0))
    )  # type: ignore[attr-defined]
    module.broken = lambda: 1 / 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "toyplug_fn", module)
    monkeypatch.setattr(plugins, "_CALLED", set())
    entry = importlib.metadata.EntryPoint(name="fn", value="toyplug_fn:register", group=plugins.GROUP)
    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", lambda group: [entry])
    try:
        for _ in range(2):
            code, _, err = run(capsys, "show", tmp_path / "missing.json")
            assert "Traceback" not in err and "already registered" not in err
        assert len(calls) == 1
    finally:
        unregister_target("toyplug-fn-gpu")
    bad = importlib.metadata.EntryPoint(name="bad", value="toyplug_fn:broken", group=plugins.GROUP)
    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", lambda group: [bad])
    code, _, err = run(capsys, "show", tmp_path / "missing.json")
    assert code == 2 and err.strip() == (
        "autoprec: error: plugin entry point bad = toyplug_fn:broken, group autoprec.plugins: loading it failed: "
        "ZeroDivisionError: division by zero; fix it or uninstall the package"
    )


def test_the_help_names_the_option():
    from autoprec.tune._cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--plugin MODULE_OR_FILE" in text and "autoprec.plugins entry points" in text


def test_a_plugin_that_prints_on_import_leaves_json_stdout_one_object(tmp_path, capsys, unregistered):
    """A plugin's print at import went to stdout before --json was read, in front of the result object (issue 60, 10):
    it goes to stderr."""
    import json

    plugin = tmp_path / "chatty.py"
    plugin.write_text("print('chatty plugin loaded')\n" + PLUGIN.format(prefix=unregistered), encoding="utf-8")
    Policy(layers={"a": "bf16"}).save(tmp_path / "policy.json")
    code, out, err = run(capsys, "--plugin", plugin, "show", tmp_path / "policy.json", "--json")
    assert code == 0, err
    assert json.loads(out)["layers"] == {"a": "bf16"} and "chatty plugin loaded" in err


@pytest.mark.parametrize("flag", ["--plug", "--plugi", "--plug=FILE"])
def test_an_abbreviated_plugin_flag_is_refused_rather_than_taken_and_never_loaded(tmp_path, capsys, flag):
    """`--plug FILE` was read by argparse as --plugin, but the plugins load before the parser by their whole name, so
    the file was never imported and the command ran without it (issue 60, 10). Abbreviations are off."""
    plugin = tmp_path / "p.py"
    plugin.write_text("", encoding="utf-8")
    argv = [flag.replace("FILE", str(plugin))] if "=" in flag else [flag, plugin]
    with pytest.raises(SystemExit) as exited:  # the parser's refusal: one line, exit 2
        main([str(a) for a in [*argv, "show", tmp_path / "policy.json"]])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "unrecognized arguments: --plug" in err and "did you mean --plugin?" in err


def test_a_bare_dash_before_the_verb_resembles_no_option(tmp_path, capsys):
    """A review found `autoprec - show ...` answered "did you mean -h?": every option starts with "-"."""
    with pytest.raises(SystemExit) as exited:
        main(["-", "show", str(tmp_path / "policy.json")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "unrecognized arguments: -" in err and "did you mean" not in err, err
    with pytest.raises(SystemExit):  # one letter typed is enough to name the option it starts
        main(["--p", "x", "show", str(tmp_path / "policy.json")])
    assert "did you mean --plugin?" in capsys.readouterr().err
