"""The one kind of table devices, goals and export targets are registered in."""

import pytest

from autoprec.registry import Registry


class Member:
    pass


def test_a_name_taken_is_refused_naming_its_holder_and_what_to_do_and_the_order_is_kept():
    table: Registry[Member] = Registry("widget")
    table["b"], table["a"] = Member(), Member()
    table.refuse_taken("c", "never said")  # free: nothing raised
    with pytest.raises(ValueError, match=r"^widget 'a' is already registered \(by test_registry\.Member\); rename it$"):
        table.refuse_taken("a", "rename it")
    assert list(table) == ["b", "a"] and table.kind == "widget"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("INT8FQ", r"widget name 'INT8FQ' must be lowercase letters, .*; register it as 'int8fq'$"),
        (" int8fq", r"widget name ' int8fq' must be lowercase .*lower-case a name, so no other can be chosen; register it as 'int8fq'$"),
        ("Taken", r"widget name 'Taken' .*; as 'taken' it is the registered widget 'taken' \(by test_registry\.Member\): give it another name$"),
        ("", r"widget name '' must be .*; give it such a name$"),
        ("my gpu", r"widget name 'my gpu' must be .*; give it such a name$"),
        ("int8\u0661", r"widget name 'int8\u0661' must be .*; give it such a name$"),  # ASCII only: no Arabic-Indic digit
        (None, r"widget name None must be .*; give it such a name$"),
    ],
)  # fmt: skip
def test_a_name_lookups_cannot_find_is_refused_naming_the_value_the_rule_and_the_fix(name, expected):
    table: Registry[Member] = Registry("widget")
    table["taken"] = Member()
    with pytest.raises(ValueError, match=expected):
        table.refuse_taken(name, "never said")
    with pytest.raises(ValueError, match=expected):  # and put in directly, as a registry without refuse_taken does
        table[name] = Member()
    assert list(table) == ["taken"]


@pytest.mark.parametrize("name", ["MyGPU", "", "my gpu", " h200"])
def test_the_target_registry_refuses_such_a_name_too(name):
    from autoprec.tune._core._targets import Target, register_target, targets

    before = targets()
    with pytest.raises(ValueError, match=rf"^target name {name!r} must be lowercase letters"):
        register_target(Target(name=name, device="a GPU", tflops={"fp32": 1.0, "bf16": 2.0}, source="made up", bandwidth_tbs=1.0))
    assert targets() == before


@pytest.mark.parametrize(
    "module, kind, plural",
    [
        ("autoprec.tune", "goal", "goals"),
        ("autoprec.tune", "target", "targets"),
        ("autoprec.formats", "family", "families"),
        ("autoprec.tune.export", "export_target", "export_targets"),
    ],
)
def test_every_named_registry_speaks_the_same_four_verbs(module, kind, plural):
    """register_X, unregister_X (which returns what it removed), Xs() (the members, in order) and X_named(name),
    public where users add: one spelling for every registry a user adds to by name. (Devices are found by a torch device, not a name:
    autoprec.devices.device_for and lookup.)"""
    import importlib
    import inspect

    found = importlib.import_module(module)
    for verb in (f"register_{kind}", f"unregister_{kind}", plural, f"{kind}_named"):
        assert callable(getattr(found, verb, None)), f"{module} has no {verb}"
    assert inspect.signature(getattr(found, f"unregister_{kind}")).return_annotation not in (
        "None",
        None,
        inspect.Signature.empty,
    )
