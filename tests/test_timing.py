"""Step times: the clock, interleaved rounds, their spread and the noise helpers (autoprec/tune/_timing.py)."""

import pytest
import torch

from autoprec.tune import _timing as timing
from autoprec.tune._config import TimingConfig
from autoprec.tune._timing import Timing, interleaved_times, probe_times


def test_interleaved_times_rotates_and_counts_rounds():
    order = []
    work = {name: (lambda n=name: order.append(n)) for name in "abc"}
    times = interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=0, rounds=3, min_block_s=0.0))
    assert set(times) == {"a", "b", "c"} and all(len(t.samples_ms) == 3 for t in times.values())
    timed = order[3:]  # after one sizing call each
    assert timed[:3] == ["a", "b", "c"] and timed[3:6] == ["b", "c", "a"] and timed[6:] == ["c", "a", "b"]


def test_warmup_counts_every_call_before_the_rounds_and_the_last_one_sizes_the_blocks():
    calls = {"a": 0}
    work = {"a": lambda: calls.__setitem__("a", calls["a"] + 1)}
    interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=3, rounds=2, min_block_s=0.0))
    assert calls["a"] == 3 + 2  # three warm-up calls (no extra sizing call), one step per round
    calls["a"] = 0
    interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=3, rounds=2, min_block_s=0.0), warmed={"a"})
    assert calls["a"] == 1 + 2  # warmed up before: one call to size the blocks


def test_a_sequential_test_stops_the_rounds_once_enough_but_never_before_min_rounds():
    from autoprec.tune._config import MIN_ROUNDS

    work = {"a": lambda: None, "b": lambda: None}
    config = TimingConfig(warmup=0, rounds=9, min_block_s=0.0)
    asked = []

    def enough(samples):
        asked.append(len(samples["a"]))
        return len(samples["a"]) >= 4

    times = interleaved_times(work, torch.device("cpu"), config, enough=enough)
    assert asked == [MIN_ROUNDS, 4] and all(len(t.samples_ms) == 4 for t in times.values())
    never = interleaved_times(work, torch.device("cpu"), config, enough=lambda s: False)
    assert all(len(t.samples_ms) == 9 for t in never.values())


def test_more_rounds_are_pooled_with_the_first_on_the_same_warm_callables_and_keep_the_rotation():
    order = []
    work = {name: (lambda n=name: order.append(n)) for name in "ab"}
    asked = []

    def more(samples):
        asked.append({n: len(v) for n, v in samples.items()})
        return 3

    times = interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=2, rounds=3, min_block_s=0.0), more=more)
    assert asked == [{"a": 3, "b": 3}]  # asked once, after the rounds
    assert all(len(t.samples_ms) == 6 for t in times.values())  # the extra rounds pooled with the first three
    assert order[4:] == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b", "b", "a"]  # no warm-up again; round 4 rotates on
    assert interleaved_times({}, torch.device("cpu"), TimingConfig(warmup=0, rounds=2), more=more) == {}
    none = interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=0, rounds=2, min_block_s=0.0), more=lambda s: 0)
    assert all(len(t.samples_ms) == 2 for t in none.values())


def test_more_rounds_only_when_a_spread_is_too_wide_to_rank(caplog):
    from autoprec.tune._config import NOISY_SPREAD
    from autoprec.tune._timing import more_if_noisy, noisiest

    calm = {"a": [10.0, 10.2, 9.9, 10.1, 10.0], "b": [20.0, 20.5, 19.8, 20.1, 20.0]}
    loud = dict(calm, b=[20.0, 35.0, 12.0, 28.0, 20.0])
    assert noisiest(calm) < NOISY_SPREAD < noisiest(loud) and noisiest({}) == 0.0
    with caplog.at_level("WARNING", logger="autoprec"):
        assert more_if_noisy(11)(calm) == 0 and not caplog.records
        assert more_if_noisy(11)(loud) == 11
    assert "timing 11 rounds more" in caplog.records[0].message


def test_a_sequential_test_may_stop_the_extra_rounds_too():
    work = {"a": lambda: None}
    asked = []

    def enough(samples):
        asked.append(len(samples["a"]))
        return len(samples["a"]) >= 6

    times = interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=0, rounds=4, min_block_s=0.0),
                              enough=lambda s: enough(s) and len(s["a"]) > 4, more=lambda s: 10)  # fmt: skip
    assert len(times["a"].samples_ms) == 6 and asked == [3, 5, 6]  # not asked at the first pass's last round


def test_the_final_remeasure_is_settled_once_every_candidates_rounds_agree_and_not_before_five():
    from autoprec.tune._config import SETTLED_FINAL_ROUNDS
    from autoprec.tune._timing import all_settled

    tight = [10.0, 10.1, 9.9, 10.05, 10.0]
    assert all_settled({"a": tight, "b": [20.0, 20.1, 19.9, 20.0, 20.2]})
    assert not all_settled({"a": tight[: SETTLED_FINAL_ROUNDS - 1], "b": tight[: SETTLED_FINAL_ROUNDS - 1]})
    assert not all_settled({"a": tight, "b": [20.0, 26.0, 19.0, 22.0, 20.5]})  # one candidate still noisy


def test_timing_median_and_spread():
    t = Timing.from_samples([1.0, 2.0, 4.0])
    assert t.median_ms == 2.0 and t.spread == pytest.approx(1.5)  # few samples: the full range
    t = Timing.from_samples([10.0, 10.0, 11.0, 12.0, 100.0])  # one stalled round barely moves it
    assert t.median_ms == 11.0 and t.spread == pytest.approx(2.0 / 11.0)


class ScriptedClock:
    """Each call takes the next of `seconds`."""

    def __init__(self, seconds):
        self.seconds = iter(seconds)

    def time(self, work, calls, device):
        for _ in range(calls):
            work()
        return sum(next(self.seconds) for _ in range(calls))


def test_probe_times_takes_the_fastest_call(monkeypatch):
    monkeypatch.setattr(timing, "CLOCK", ScriptedClock([0.06, 0.002, 0.06]))  # a slow, a fast and a slow call
    calls = []
    probe = probe_times({"x": lambda: calls.append(1)}, torch.device("cpu"), warmup=2, repeats=3)
    assert len(calls) == 5 and probe["x"] == pytest.approx(2.0)  # the 2 ms call, not the median (60) or the mean (41)


def test_the_device_clock_runs_the_work_and_reads_the_wall_time_it_took():
    import time

    calls = []
    seconds = timing.DeviceClock().time(lambda: calls.append(time.sleep(0.01)), 3, torch.device("cpu"))
    assert len(calls) == 3 and seconds >= 0.03  # a lower bound only: a busy machine takes longer, never shorter


def test_every_step_time_is_read_through_the_clock(monkeypatch):
    # interleaved_times: the sizing call, then a block per round, each priced by the clock and per step
    monkeypatch.setattr(timing, "CLOCK", ScriptedClock([0.001] + [0.004, 0.002, 0.003]))
    t = interleaved_times({"x": lambda: None}, torch.device("cpu"), TimingConfig(warmup=1, rounds=3, min_block_s=0.0))
    assert t["x"].samples_ms == pytest.approx((4.0, 2.0, 3.0)) and t["x"].median_ms == pytest.approx(3.0)


def test_every_callable_takes_the_same_steps_in_every_round_sized_by_the_slowest(monkeypatch):
    """A time budget's re-measure timed fp16 on 9 steps beside fp32's 254 and wrote it 22x faster (issue 37, 5): block
    sizes came from each candidate's own warm-up. One block size now, from the slowest."""
    from autoprec.tune._config import TimingConfig
    from autoprec.tune._timing import interleaved_times

    seconds = {"fast": 0.001, "slow": 0.02}
    calls: dict[str, list[int]] = {"fast": [], "slow": []}

    class Clock:
        def time(self, work, n, device):
            calls[work.name].append(n)
            return seconds[work.name] * n

    class Work:
        def __init__(self, name):
            self.name = name

        def __call__(self):
            return None

    monkeypatch.setattr(timing, "CLOCK", Clock())
    config = TimingConfig(warmup=1, rounds=4, min_block_s=0.05, max_steps_per_block=50)
    interleaved_times({n: Work(n) for n in seconds}, torch.device("cpu"), config)
    assert calls["fast"][1:] == calls["slow"][1:] == [3] * 4  # ceil(0.05 / 0.02): the fast one's 50 no longer


def test_a_spread_is_written_as_stored_in_the_tables_the_first_line_and_the_warnings(caplog):
    """A stored spread of 5.12 (interquartile range over the median, as policy.json and the footnote define it) was
    printed `±256%`, half of it, by `show` and the summaries, and the noise warnings halved it too."""
    import types

    from builders import finals

    from autoprec import Policy
    from autoprec.tune._report import headline
    from autoprec.tune._show import show_policy
    from autoprec.tune._timing import more_if_noisy, spread_text

    assert spread_text(5.12) == "512.0%" and spread_text(0.04) == "4.0%" and spread_text(None) == spread_text(float("nan")) == "-"
    measured = {"chosen": "uniform bf16", "budget": 0.01, "not_separated": ["trial 3"],
                "results": {"fp32": {"speedup": 1.0, "spread": 0.02, "metric_drop": 0.0},
                            "uniform bf16": {"speedup": 1.4, "spread": 5.12, "metric_drop": 0.0}}}  # fmt: skip
    policy = Policy(layers={"": "bf16"}, measured=measured)
    shown = show_policy(policy)
    assert "512.0%" in shown and "256" not in shown
    rows = finals({"candidate": "fp32", "speedup": 1.0, "spread": 0.02, "feasible": True},
                  {"candidate": "uniform bf16", "speedup": 1.4, "spread": 5.12, "feasible": True},
                  {"candidate": "trial 3", "speedup": 1.5, "spread": 0.3, "feasible": True})  # fmt: skip
    line = headline(types.SimpleNamespace(policy=policy, finals=rows))
    assert "512.0%" in line and "256" not in line
    with caplog.at_level("WARNING", logger="autoprec"):
        more_if_noisy(3)({"a": [1.0, 1.0, 4.0, 9.0, 9.0]})
    stored = Timing.from_samples([1.0, 1.0, 4.0, 9.0, 9.0]).spread
    assert f"spread up to {spread_text(stored)}," in caplog.text and f"{100 * stored:.1f}%" in caplog.text
