import dataclasses
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from builders import finals, measurement

from autoprec import Policy, load_policy
from autoprec.files import OtherVersion
from autoprec.tune._core._records import FINALS_VERSION, Finals, Measured, Measurement, Result, StudyRef, TrialRecord

RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_a_measured_block_reads_back_as_the_record_that_wrote_it():
    m = Measured(
        device="cpu (test)", model="mlp", fingerprint="abc", budget=0.01, budget_given="1% of |fp32 metric| 1",
        mode="train", train_steps=20, noise_floor=0.002, fp32_metric=0.9, metric="accuracy", chosen="trial 3",
        why="the fastest within budget", greedy="profile greedy", compiled=True,
        results={"fp32": Result(speedup=1.0, steps=10, skipped_steps=0), "policy": Result(speedup=1.4, error="x")},
        excluded={"head": {"fp8": "too small"}}, study=StudyRef(name="s", storage="journal", trials=5, complete=4),
        cost={"seconds": {"profile": 1.5}, "counts": {"profile": 1}},
        layout={"world_size": 2, "mesh": [2], "parallelize": "model.py:parallelize"}, run_steps=100_000,
    )  # fmt: skip
    data = json.loads(json.dumps(m.to_dict()))  # through JSON, as a policy file holds it
    assert Measured.from_dict(data) == m
    assert "layout" not in Measured().to_dict() and "run_steps" not in Measured().to_dict()  # one device, no run given
    assert Measured.of(Policy(measured=data)).policy_result == Result(speedup=1.4, error="x")


def test_a_malformed_or_unknown_field_reads_as_missing_and_unknown_ones_are_written_back():
    m = Measured.from_dict({"budget": "0.01", "compiled": "yes", "results": {"policy": {"speedup": "fast", "steps": 3.5}},
                            "study": [1], "from_the_future": {"a": 1}})  # fmt: skip
    assert m.budget is None and m.compiled is False and m.study == StudyRef()
    assert m.results["policy"] == Result()
    assert m.to_dict()["from_the_future"] == {"a": 1}
    assert Measured.from_dict(None) == Measured() and Measured.of(Policy()) == Measured()


def test_a_number_past_floats_or_int64s_range_reads_as_missing():
    big = 10**400  # a JSON integer Python reads, that float() cannot hold (OverflowError)
    m = Measured.from_dict({"budget": big, "fp32_metric": big, "max_memory": big, "train_steps": 2**63,
                            "results": {"policy": {"speedup": big, "metric": big, "peak_bytes": big, "steps": 3}}})  # fmt: skip
    assert m.budget is None and m.fp32_metric is None and m.max_memory is None and m.train_steps is None
    assert m.results["policy"] == Result(steps=3)


def test_every_committed_policy_file_reads_as_a_record():
    files = sorted(RESULTS.rglob("policy*.json"))
    assert len(files) >= 10  # the committed results are there (a move would otherwise pass silently)
    for path in files:
        m = Measured.of(load_policy(path))
        assert m.chosen and m.budget is not None and m.device, path
        assert m.policy_result is not None and m.policy_result.speedup and m.policy_result.speedup > 0, path


def test_a_result_keeps_null_where_a_number_was_not_finite_and_leaves_out_what_was_not_measured():
    broken = measurement("x", metric=math.nan, metric_drop=math.inf, runs=False, speedup=math.nan, error="boom")
    r = Result.of(broken)
    assert r.metric is None and r.metric_drop is None and r.speedup is None and r.error == "boom"
    assert (
        "train_skipped_steps" not in Result.of(measurement("y")).to_dict()
        and "error" not in Result.of(measurement("y")).to_dict()
    )
    assert Result.of(measurement("z", train_skipped=2)).to_dict()["train_skipped_steps"] == 2


def test_finals_look_up_by_name_and_refuse_a_candidate_measured_twice():
    f = finals({"candidate": "fp32"}, {"candidate": "x", "speedup": 1.5})
    assert f.names == ["fp32", "x"] and f.by_name("x").speedup == 1.5 and f.get("y") is None and f[1].candidate == "x"
    with pytest.raises(KeyError, match=r"no candidate 'y' was re-measured; the candidates are \['fp32', 'x'\]"):
        f.by_name("y")
    with pytest.raises(ValueError, match="each candidate is measured once"):
        finals({"candidate": "fp32"}, {"candidate": "fp32"})


def test_finals_judged_against_another_budget_and_their_noisiest_spread():
    f = finals({"candidate": "a", "metric_drop": 0.001, "spread": 0.1},
               {"candidate": "b", "metric_drop": 0.01, "spread": 0.2},
               {"candidate": "broken", "runs": False, "metric_drop": 0.0, "spread": 9.0})  # fmt: skip
    assert [r.feasible for r in f.within(0.005)] == [True, False, False]
    assert [r.feasible for r in f.within(0.05)] == [True, True, False]  # a candidate that did not run never fits
    assert f.noisiest() == 0.2 and Finals().noisiest() == 0.0  # the failed run's spread is not the machine's
    # fp32 put out of the running after 2 of 7 rounds (a GPU's bf16 10x faster): its range is no ranking's noise
    retired = finals({"candidate": "fp32", "spread": 0.4, "rounds": 2}, {"candidate": "uniform bf16", "spread": 0.01, "rounds": 7},
                     {"candidate": "trial 3", "spread": 0.02, "rounds": 7})  # fmt: skip
    assert retired.noisiest() == 0.02


def test_finals_round_trip_through_csv_with_empty_cells_and_errors(tmp_path):
    f = Finals([
        measurement("fp32", compile_s=1.25, train_skipped=0),
        measurement("x, fp16/fp8 -> bf16", metric=math.nan, runs=False, feasible=False, speedup=math.nan,
                    error="RuntimeError: no, really"),
    ])  # fmt: skip
    f.to_csv(tmp_path / "finalists.csv")
    back = Finals.read_csv(tmp_path / "finalists.csv")
    assert back.names == f.names and back[0] == f[0]
    assert back[1].error == "RuntimeError: no, really" and math.isnan(back[1].metric) and back[1].compile_s is None
    assert list(f.to_frame().columns)[:3] == ["candidate", "metric", "metric_drop"]


def test_a_finalists_file_of_another_version_or_none_is_refused_as_another_versions(tmp_path):
    path = tmp_path / "finalists.csv"
    finals({"candidate": "fp32"}).to_csv(path)
    assert path.read_text().splitlines()[0].endswith(",version") and Finals.read_csv(path).names == ["fp32"]
    frame = pd.read_csv(path)
    for other, shown in (
        (frame.drop(columns="version"), "none"),
        (frame.assign(version=FINALS_VERSION + 1), str(FINALS_VERSION + 1)),
    ):
        other.to_csv(path, index=False)
        with pytest.raises(OtherVersion, match=rf"finalists.csv: written by another autoprec version \(format version {shown}; "):
            Finals.read_csv(path)


def test_a_finalists_file_of_this_version_missing_a_column_is_refused_by_name(tmp_path):
    path = tmp_path / "finalists.csv"
    finals({"candidate": "fp32"}).to_frame().drop(columns="rounds").assign(version=FINALS_VERSION).to_csv(path, index=False)
    with pytest.raises(ValueError, match=r"finalists.csv: no column 'rounds'"):
        Finals.read_csv(path)


def test_a_measurement_needs_every_measured_field():
    with pytest.raises(TypeError):
        Measurement(candidate="x", metric=1.0)  # type: ignore[call-arg]


def test_a_malformed_finalists_row_is_refused_with_its_row_and_candidate(tmp_path):
    f = finals({"candidate": "fp32"}, {"candidate": "x"})
    f.to_csv(tmp_path / "f.csv")
    lines = (tmp_path / "f.csv").read_text().splitlines()
    lines[2] = lines[2].replace(",True,", ",,", 1)  # x's `runs` cell emptied: True/False must be there
    (tmp_path / "f.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"f.csv: row 3 \('x'\) is malformed: expected True or False"):
        Finals.read_csv(tmp_path / "f.csv")


def test_peak_memory_and_the_limit_round_trip_and_a_candidate_that_does_not_fit_is_never_feasible(tmp_path):
    f = Finals([measurement("fp32", peak_bytes=1000, memory_saving=0.0),
                measurement("x", peak_bytes=2500, memory_saving=-1.5, fits=False, feasible=False),
                measurement("y")])  # fmt: skip
    f.to_csv(tmp_path / "finalists.csv")
    back = Finals.read_csv(tmp_path / "finalists.csv")
    assert back[0] == f[0] and back[1].peak_bytes == 2500 and back[1].fits is False and back[2].peak_bytes is None
    assert [r.feasible for r in back.within(1.0)] == [True, False, True]  # any budget: x needs too much memory
    r = Result.of(back[1])
    assert r.peak_bytes == 2500 and r.memory_saving == -1.5
    assert "peak_bytes" not in Result.of(back[2]).to_dict()  # not measured: left out, as train_skipped_steps
    m = Measured(memory="CUDA allocator peak", max_memory=40 * 10**9, objective="memory", results={"policy": r})
    assert Measured.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert Measured.from_dict({}).objective == "speed" and "max_memory" not in Measured().to_dict()


def test_a_trial_record_round_trips_through_the_attributes_optuna_stores_as_json():
    record = TrialRecord(metric=0.9, metric_drop=0.01, feasible=True, step_ms=5.0, skipped=0, steps=12,
                         effective_step_ms=5.0, fp32_step_ms=10.0, speedup=2.0, spread=0.04, peak_bytes=2**40,
                         memory_saving=0.25, train_skipped=1, error="x", predicted_speedup=1.9, untimed="why",
                         evaluate_s=0.5, measure_s=1.5, compile_s=0.25, rounds=3, reused_from=4, reevaluated_from=2)  # fmt: skip
    attrs = json.loads(json.dumps(record.to_attrs()))
    assert set(attrs) == {f.name for f in dataclasses.fields(TrialRecord)}  # the keys are the field names
    assert TrialRecord.from_attrs(attrs) == record
    measured = record.to_attrs(costs=False)  # what a repeat copies: not the time this trial took, nor where from
    assert "evaluate_s" not in measured and "reused_from" not in measured and measured["speedup"] == 2.0


def test_a_trial_record_reads_a_missing_or_malformed_attribute_as_unset_and_ignores_bookkeeping():
    attrs = {"speedup": 1.5, "feasible": 1, "rounds": 2.0, "steps": True, "error": 3, "autoprec:worker": "w", "metric": None}
    record = TrialRecord.from_attrs(attrs)
    assert record == TrialRecord(speedup=1.5)  # a wrong type reads as missing; the study's own keys are not a trial's
    assert record.to_attrs() == {"speedup": 1.5}  # only what is set
    assert TrialRecord.from_attrs({}) == TrialRecord() and not TrialRecord().timed


def test_a_trial_record_is_timed_only_where_the_trial_itself_was_timed():
    assert TrialRecord(rounds=3).timed and not TrialRecord(rounds=0).timed
    assert not TrialRecord(rounds=3, reused_from=1).timed  # a repeat copies the rounds, measures nothing


class _Trial:  # what TrialRecord.write needs of an optuna.Trial
    def __init__(self):
        self.user_attrs = {}

    def set_user_attr(self, key, value):
        self.user_attrs[key] = value


def test_the_trial_writer_refuses_a_name_or_a_value_the_record_would_not_read_back():
    trial = _Trial()
    TrialRecord.write(trial, speedup=2.0, peak_bytes=None, rounds=3, error="e")
    assert trial.user_attrs == {"speedup": 2.0, "peak_bytes": None, "rounds": 3, "error": "e"}  # None is written too
    assert TrialRecord.of(trial) == TrialRecord(speedup=2.0, rounds=3, error="e")
    with pytest.raises(TypeError, match="speedp.*speedup"):
        TrialRecord.write(trial, speedp=1.0)  # a typo fails loudly, naming the fields
    with pytest.raises(TypeError, match="rounds"):
        TrialRecord.write(trial, rounds=2.5)
    with pytest.raises(TypeError, match="feasible"):
        TrialRecord.write(trial, feasible=1)
    assert trial.user_attrs == {"speedup": 2.0, "peak_bytes": None, "rounds": 3, "error": "e"}  # nothing half-written


def _journal_attrs(path):
    """Each trial's user attributes as an Optuna journal holds them: JSON lines, each an operation (4: a trial created
    with some, 8: one set on a trial; trial ids count the created trials)."""
    trials: list[dict] = []
    for line in path.read_text().splitlines():
        op = json.loads(line)
        if op["op_code"] == 4:
            trials.append(dict(op.get("user_attrs") or {}))
        elif op["op_code"] == 8:
            trials[op["trial_id"]].update(op["user_attr"])
    return trials


def test_every_committed_studys_trials_read_back_as_records_with_every_measurement_kept():
    fields = {f.name for f in dataclasses.fields(TrialRecord)}
    trials = [(path, attrs) for path in sorted(RESULTS.rglob("*.journal")) for attrs in _journal_attrs(path)]
    assert sum("speedup" in attrs for _, attrs in trials) > 100
    for path, attrs in trials:
        measured = {k: v for k, v in attrs.items() if k in fields and v is not None}
        assert set(attrs) - fields <= {"autoprec:key", "autoprec:choices", "autoprec:worker", "key", "choices"}, path
        assert TrialRecord.from_attrs(attrs).to_attrs() == measured, path


def test_trials_csv_has_a_column_per_trial_record_field_in_the_order_committed_tables_have():
    import optuna

    from autoprec.tune._decide._trials import trials_table
    from autoprec.tune._measure._choices import LAYER_PARAM, Choices

    committed = pd.read_csv(RESULTS / "cpu-epyc-avx2-2core/search-cost/digits/trials.csv", nrows=0).columns.tolist()
    measured = committed[committed.index("metric") : committed.index("reevaluated_from") + 1]
    choices = Choices(default=("fp32",), layers={"a": ("fp32", "bf16")}, excluded={})
    study = optuna.create_study(direction="maximize")
    attrs = {"speedup": 1.5, "feasible": True, "rounds": 3, "untimed": None, "autoprec:worker": "w"}
    dist = {LAYER_PARAM + "a": optuna.distributions.CategoricalDistribution(["fp32", "bf16"])}
    study.add_trial(
        optuna.trial.create_trial(value=1.5, params={LAYER_PARAM + "a": "bf16"}, distributions=dist, user_attrs=attrs)
    )
    table = trials_table(study, choices)
    columns = table.columns.tolist()
    assert columns[columns.index("metric") : columns.index("reevaluated_from") + 1] == measured
    assert measured == [f.name for f in dataclasses.fields(TrialRecord)] and "autoprec:worker" not in columns
    row = table.iloc[0]
    assert (row["speedup"], row["feasible"], row["rounds"], row["a"]) == (1.5, True, 3, "bf16") and pd.isna(row["metric"])
