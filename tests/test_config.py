"""autoprec/tune/_core/_config.py: what a search is configured with, and what each setting means for the others."""

import dataclasses

import pytest

from autoprec.tune import ProfileConfig, SearchConfig


def test_budget_must_not_be_negative():
    with pytest.raises(ValueError, match=r"budget must be .*>= 0.*-0.5"):
        SearchConfig(budget=-0.5)
    with pytest.raises(ValueError, match=r"budget must be a finite number >= 0 .*but got '-1%'"):
        SearchConfig(budget="-1%")
    with pytest.raises(ValueError, match=r"a budget must be a number in the metric's units \(0.01\) or a percentage .*'x'"):
        SearchConfig(budget="x")


def test_the_budget_is_kept_as_given_a_relative_one_for_the_pipeline_to_resolve():
    """One place holds a search's budget as the user gave it: a number stays one (a string of one too), a percentage
    stays relative, and a sweep's config holds none (None, the default)."""
    from autoprec.tune._core._budget import Budget
    from autoprec.tune._core._config import search_config

    assert SearchConfig(budget=0.01).budget == 0.01 and SearchConfig(budget="0.01").budget == 0.01
    assert SearchConfig(budget=Budget(0.02)).budget == 0.02 and isinstance(SearchConfig(budget=1).budget, float)
    assert SearchConfig(budget="1%").budget == Budget(0.01, relative=True) == SearchConfig(budget=Budget(0.01, True)).budget
    assert SearchConfig().budget is None and search_config(device="cpu").budget is None
    assert search_config(device="cpu", budget="0.5%").budget == Budget(0.005, relative=True)


def test_a_search_profiles_only_the_offered_formats_numerics_and_a_profile_alone_all_of_them():
    assert SearchConfig(budget=0.1, profile=ProfileConfig(batches=4)).profile.numerics == "offered"
    assert SearchConfig(budget=0.1, profile=ProfileConfig(numerics="all")).profile.numerics == "all"
    assert ProfileConfig().numerics is None  # profile() reads None as "all"


def test_compile_is_one_switch_the_search_owns_and_its_configs_stay_as_given():
    """The profile's layer timings are compiled as the search's steps are: derived from SearchConfig.compile, never
    written back into the frozen config (which kept a second copy in step by mutating it)."""
    given = ProfileConfig(batches=4, numerics="all")
    config = SearchConfig(budget=0.1, compile=True, profile=given)
    assert config.profile is given and config.profile.compile is False  # as the caller gave it
    assert config.profile_settings.compile is True and config.profile_settings.batches == 4
    eager = SearchConfig(budget=0.1, profile=given)
    assert eager.profile_settings is given  # nothing to derive
    assert dataclasses.replace(config, compile=False).profile_settings.compile is False  # follows the switch
    with pytest.raises(ValueError, match=r"profile=ProfileConfig\(compile=True\) needs compile=True"):
        SearchConfig(budget=0.1, profile=ProfileConfig(compile=True))
    assert SearchConfig(budget=0.1, compile=True, profile=ProfileConfig(compile=True)).profile_settings.compile is True


def test_cuda_graphs_are_asked_for_only_on_a_compiled_search_on_a_device_that_records_them(monkeypatch):
    from autoprec import devices
    from autoprec.tune._core._config import search_config

    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731 (the CLI's spelling)
    with pytest.raises(
        ValueError, match=r"^--cuda-graphs needs a device that records CUDA graphs \(cuda\), but the device is cpu"
    ):
        search_config(device="cpu", compile=True, cuda_graphs=True, spell=flag)
    monkeypatch.setattr(devices.lookup("cpu"), "cuda_graphs", True)  # a CPU standing in for a GPU
    with pytest.raises(ValueError, match=r"^--cuda-graphs needs a compiled search .*leave --compile on"):
        search_config(device="cpu", compile=False, cuda_graphs=True, spell=flag)
    assert search_config(device="cpu", compile=True, cuda_graphs=True).cuda_graphs
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs compile=True"):
        SearchConfig(budget=0.1, cuda_graphs=True)


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "1000"])
def test_run_steps_is_a_whole_number_of_training_steps(bad):
    assert SearchConfig(budget=0.01, run_steps=200_000).run_steps == 200_000
    with pytest.raises(ValueError, match=rf"run_steps must be an integer >= 1 .*but got {bad!r}"):
        SearchConfig(budget=0.01, run_steps=bad)
