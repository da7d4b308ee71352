import dataclasses
import json
import math
from pathlib import Path

import pytest
from builders import small_task
from short_timing import TINY, fixed_layer_times

from autoprec.files import OtherVersion
from autoprec.tune import ProfileConfig, load_task, prepare
from autoprec.tune._core._space import space_from_dict
from autoprec.tune._measure._profile_data import Profile
from autoprec.tune._search._out_dir import claim_out_dir, load_or_profile

MODELS = Path(__file__).parent / "models"
FAST = ProfileConfig(batches=2, timing=TINY)


def test_an_out_folder_a_live_run_holds_for_another_model_is_refused_and_the_same_model_may_join(
    tmp_path, write_model, mlp_source
):
    # Two models started together on one --out both passed check_out_dir (nothing written yet) and one's results
    # replaced the other's: the folder is now claimed before anything is written, for as long as a run lasts.
    from autoprec import UserError

    mine = prepare(load_task(write_model(mlp_source, "a/model.py")), "cpu")
    other = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    out = tmp_path / "out"
    with claim_out_dir(mine, out):
        with pytest.raises(UserError) as err:
            with claim_out_dir(other, out):
                pytest.fail("another model got the folder while a run held it")
        message = str(err.value)
        assert f"--out {out}: a run for another model is writing there now" in message and "\n" not in message
        assert str(MODELS / "overflow_mlp.py") in message and str(mine.task.path) in message
        with claim_out_dir(mine, out):  # a second worker of the same model, or a resume
            pass
    with claim_out_dir(other, out):  # the run ended and left no results: the folder is free
        pass


# ---- the saved profile, reused where it serves ----------------------------------------------------


def test_a_sequential_models_numeric_layer_names_load_back_as_names_and_the_saved_profile_is_reused(tmp_path, write_model):
    """nn.Sequential names its layers "0", "2": read back as integers they never matched, so every rerun and
    every worker profiled again and rewrote the shared profile."""
    from autoprec.tune import SearchConfig
    from autoprec.tune._measure._timing import Stopwatch

    path = write_model(
        small_task(
            "def build_model():\n    torch.manual_seed(0)\n    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))\n"
        )
    )
    workload = prepare(load_task(path), "cpu")
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16"]}})
    config = SearchConfig(budget=0.1, progress=False, profile=FAST)
    load_or_profile(workload, space, tmp_path, config)
    loaded = Profile.load(tmp_path)
    assert loaded.layers() == ["0", "2"] and set(loaded.grad_ranges["layer"]) == {"0", "2"}
    watch = Stopwatch()
    load_or_profile(workload, space, tmp_path, config, watch=watch)
    assert watch.counts == {"profile: reused the one saved in the output folder": 1}


def test_a_saved_profile_of_the_same_structure_with_other_weights_is_measured_again(tmp_path, write_model):
    """A GPU machine retrains the GPT-2 example on every fresh start: same structure, other weights, other
    sensitivities; the profile of the old weights must not be read as this model's."""
    from autoprec.tune import SearchConfig
    from autoprec.tune._measure._timing import Stopwatch

    source = "def build_model():\n    torch.manual_seed({seed})\n    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))\n"
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16"]}})
    config = SearchConfig(budget=0.1, progress=False, profile=FAST)
    first = prepare(load_task(write_model(small_task(source.format(seed=0)), "a/model.py")), "cpu")
    load_or_profile(first, space, tmp_path, config)
    assert Profile.load(tmp_path).weights == first.weights
    other = prepare(load_task(write_model(small_task(source.format(seed=1)), "b/model.py")), "cpu")
    assert other.weights != first.weights
    watch = Stopwatch()
    load_or_profile(other, space, tmp_path, config, watch=watch)
    assert "profile: reused the one saved in the output folder" not in watch.counts
    assert Profile.load(tmp_path).weights == other.weights


@pytest.mark.parametrize(("column", "value"), [("shape", "16xabc"), ("tokens", "abc")])
def test_a_hand_edited_profile_cell_is_said_by_file_line_layer_column_and_value_and_measured_again(
    tmp_path, caplog, column, value
):
    """Under --objective flops a bad shape was an error naming neither file nor cell, and bad tokens left every
    Linear uncounted without a word: the profile was read as it was."""
    from autoprec.tune import SearchConfig
    from autoprec.tune._core._profile_row import COLUMNS

    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16"]}})
    config = SearchConfig(budget=0.1, progress=False, profile=FAST)
    load_or_profile(workload, space, tmp_path, config)
    csv = tmp_path / "profile.csv"
    lines = csv.read_text().splitlines()
    cells = lines[1].split(",")
    cells[COLUMNS.index(column)] = value
    csv.write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    with caplog.at_level("WARNING", logger="autoprec"):
        load_or_profile(workload, space, tmp_path, config)
    assert f"{csv}: line 2 (layer 'fc1'), column {column}: '{value}' is not " in caplog.text
    assert "profiling again" in caplog.text
    assert value not in csv.read_text()  # measured again, the file repaired


def test_a_corrupt_saved_profile_is_measured_again(tmp_path, caplog):
    from autoprec.tune import SearchConfig

    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16"]}})
    (tmp_path / "profile.csv").write_text("garbage\n\x00")
    (tmp_path / "profile.json").write_text("{not json")
    with caplog.at_level("WARNING", logger="autoprec"):
        prof = load_or_profile(workload, space, tmp_path, SearchConfig(budget=0.1, progress=False, profile=FAST))
    assert "the saved profile cannot be read" in caplog.text and prof.layers() == ["fc1", "big", "head"]
    assert Profile.load(tmp_path).layers() == ["fc1", "big", "head"]  # the repaired files


def test_a_saved_profile_of_another_version_or_none_is_measured_again_with_one_warning(tmp_path, caplog):
    """Its numbers may mean something else in this version: never read, measured again, and the line says why."""
    from autoprec.tune import SearchConfig
    from autoprec.tune._measure._profile_data import PROFILE_VERSION
    from autoprec.tune._measure._timing import Stopwatch

    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16"]}})
    config = SearchConfig(budget=0.1, progress=False, profile=FAST)
    load_or_profile(workload, space, tmp_path, config)
    meta = json.loads((tmp_path / "profile.json").read_text())
    assert meta["version"] == PROFILE_VERSION
    for other, shown in (
        ({**meta, "version": PROFILE_VERSION + 1}, str(PROFILE_VERSION + 1)),
        (meta | {"version": None}, "none"),
    ):
        (tmp_path / "profile.json").write_text(json.dumps(other))
        with pytest.raises(OtherVersion, match=rf"profile.json: written by another autoprec version \(format version {shown};"):
            Profile.load(tmp_path)
        caplog.clear()
        watch = Stopwatch()
        with caplog.at_level("INFO", logger="autoprec"):
            load_or_profile(workload, space, tmp_path, config, watch=watch)
        assert [r.getMessage() for r in caplog.records] == [
            f"{tmp_path / 'profile.json'}: written by another autoprec version (format version {shown}; this version "
            f"reads {PROFILE_VERSION}); profiling again"
        ]
        assert "profile: reused the one saved in the output folder" not in watch.counts
        assert json.loads((tmp_path / "profile.json").read_text())["version"] == PROFILE_VERSION  # measured and saved anew


def test_a_saved_profile_with_skipped_metrics_is_reused_only_where_they_stay_ruled_out(tmp_path, monkeypatch):
    from autoprec.tune import SearchConfig
    from autoprec.tune._measure import _profiler as profiler
    from autoprec.tune._measure._timing import Stopwatch

    monkeypatch.setattr(profiler, "_time_layer", fixed_layer_times({"bf16": 2.0}))
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    config = SearchConfig(budget=0.1, progress=False, profile=dataclasses.replace(FAST, numerics="offered"))
    strict = space_from_dict({"layers": {"Linear": ["fp32", "bf16"]}, "prune": {"slower_than": 1.25}})
    load_or_profile(workload, strict, tmp_path, config)
    watch = Stopwatch()
    load_or_profile(workload, strict, tmp_path, config, watch=watch)
    assert watch.counts == {"profile: reused the one saved in the output folder": 1}
    lenient = space_from_dict({"layers": {"Linear": ["fp32", "bf16"]}, "prune": {"slower_than": 3.0}})
    watch = Stopwatch()
    again = load_or_profile(workload, lenient, tmp_path, config, watch=watch)  # bf16 is in play now: judged
    assert "profile: reused the one saved in the output folder" not in watch.counts
    sources = [r.metric_source for r in again.rows if r.format == "bf16"]
    assert sources and all(s.startswith(("measured", "predicted")) for s in sources)


def test_a_search_profile_predicts_within_a_tenth_of_its_budget_and_is_reused_only_as_precise(tmp_path):
    from autoprec.tune import SearchConfig
    from autoprec.tune._measure._timing import Stopwatch

    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"layers": {"Linear": ["fp32", "bf16"]}, "prune": {"slower_than": 1e9}})
    loose = SearchConfig(budget=0.5, progress=False, profile=FAST)
    prof = load_or_profile(workload, space, tmp_path, loose)
    bf16 = [r.metric_source for r in prof.rows if r.format == "bf16"]
    assert prof.group_tolerance == pytest.approx(0.05)
    assert bf16.count("measured") == 1 and sum(s.startswith("predicted") for s in bf16) == 2
    assert Profile.load(tmp_path).group_tolerance == pytest.approx(0.05)
    watch = Stopwatch()
    load_or_profile(workload, space, tmp_path, loose, watch=watch)
    assert watch.counts == {"profile: reused the one saved in the output folder": 1}
    watch = Stopwatch()
    tight = load_or_profile(workload, space, tmp_path, SearchConfig(budget=0.05, progress=False, profile=FAST), watch=watch)
    assert "profile: reused the one saved in the output folder" not in watch.counts and tight.group_tolerance == pytest.approx(
        0.005
    )


def test_a_profile_of_autoprec_profile_measured_alone_is_reused_by_any_search(tmp_path):
    from autoprec.tune import SearchConfig
    from autoprec.tune._measure._timing import Stopwatch

    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"layers": {"Linear": ["fp32", "bf16"]}, "prune": {"slower_than": 1e9}})
    # group_testing=False wins over a tolerance: every drop measured alone
    alone = SearchConfig(budget=0.5, progress=False, profile=dataclasses.replace(FAST, group_testing=False, group_tolerance=0.1))
    first = load_or_profile(workload, space, tmp_path, alone)
    assert first.group_tolerance is None and all(r.metric_source == "measured" for r in first.rows)
    watch = Stopwatch()
    load_or_profile(workload, space, tmp_path, SearchConfig(budget=0.001, progress=False, profile=FAST), watch=watch)
    assert watch.counts == {"profile: reused the one saved in the output folder": 1}  # every drop measured: precise


def test_a_saved_profile_that_left_numerics_unmeasured_does_not_serve_a_search_that_asks_for_all(tmp_path, monkeypatch):
    from autoprec.tune import SearchConfig
    from autoprec.tune._measure import _profiler as profiler
    from autoprec.tune._measure._timing import Stopwatch

    monkeypatch.setattr(profiler, "_time_layer", fixed_layer_times({"bf16": 2.0}))
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"layers": {"Linear": ["fp32", "bf16"]}, "prune": {"slower_than": 1.25}})
    offered = SearchConfig(budget=0.1, progress=False, profile=dataclasses.replace(FAST, numerics="offered"))
    assert load_or_profile(workload, space, tmp_path, offered).numerics == "offered"
    watch = Stopwatch()
    again = load_or_profile(
        workload, space, tmp_path, dataclasses.replace(offered, profile=dataclasses.replace(FAST, numerics="all")), watch=watch
    )
    assert "profile: reused the one saved in the output folder" not in watch.counts and again.numerics == "all"
    assert not math.isnan(again.row("fc1", "bf16").sqnr_db)  # measured now, though slower than fp32 here


def test_a_profile_measured_again_takes_the_old_profiles_figures_with_it(tmp_path):
    """A sweep measured a new profile over an old one, then was refused its study before drawing: the old heat maps
    stood beside the new profile's files (issue 60, 10). They go when the profile they were drawn from is replaced, and
    a reused profile keeps its own."""
    from autoprec.tune import SearchConfig

    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    config = SearchConfig(budget=0.1, progress=False, profile=FAST)
    load_or_profile(workload, space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32"]}}), tmp_path, config)
    for name in ("profile.png", "grad_ranges.png"):
        (tmp_path / name).write_bytes(b"the old profile's figure")
    load_or_profile(workload, space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32"]}}), tmp_path, config)
    assert (tmp_path / "profile.png").is_file()  # reused: its figures are its own
    load_or_profile(workload, space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16"]}}), tmp_path, config)
    assert not (tmp_path / "profile.png").exists() and not (tmp_path / "grad_ranges.png").exists()
