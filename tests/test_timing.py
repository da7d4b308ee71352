"""Step times: the clock, interleaved rounds, their spread, the noise helpers and the three rules that tell one speedup
from another beyond the noise (autoprec/tune/_measure/_timing.py)."""

import gc
import types

import pytest
import timings
import torch

from autoprec.tune._core._config import MIN_STEPS_PER_SAMPLE, SETTLED, TimingConfig
from autoprec.tune._measure import _timing as timing
from autoprec.tune._measure._timing import Timing, beaten, interleaved_times, may_beat, probe_times, separated


def test_interleaved_times_rotates_and_counts_rounds():
    order = []
    work = {name: (lambda n=name: order.append(n)) for name in "abc"}
    times = interleaved_times(
        work, torch.device("cpu"), TimingConfig(warmup=0, rounds=3, min_block_s=0.0, warmup_s=0.0, min_steps=1)
    )
    assert set(times) == {"a", "b", "c"} and all(len(t.samples_ms) == 3 for t in times.values())
    timed = order[3:]  # after one sizing call each
    assert timed[:3] == ["a", "b", "c"] and timed[3:6] == ["b", "c", "a"] and timed[6:] == ["c", "a", "b"]


def test_warmup_counts_every_call_before_the_rounds_and_the_last_one_sizes_the_blocks():
    calls = {"a": 0}
    work = {"a": lambda: calls.__setitem__("a", calls["a"] + 1)}
    interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=3, rounds=2, min_block_s=0.0, warmup_s=0.0, min_steps=1))
    assert calls["a"] == 3 + 2  # three warm-up calls (no extra sizing call), one step per round
    calls["a"] = 0
    interleaved_times(
        work, torch.device("cpu"), TimingConfig(warmup=3, rounds=2, min_block_s=0.0, warmup_s=0.0, min_steps=1), warmed={"a"}
    )
    assert calls["a"] == 1 + 2  # warmed up before: one call to size the blocks


def test_a_sequential_test_stops_the_rounds_once_enough_but_never_before_min_rounds():
    from autoprec.tune._core._config import MIN_ROUNDS

    work = {"a": lambda: None, "b": lambda: None}
    config = TimingConfig(warmup=0, rounds=9, min_block_s=0.0, warmup_s=0.0, min_steps=1)
    asked = []

    def enough(samples):
        asked.append(len(samples["a"]))
        return len(samples["a"]) >= 4

    times = interleaved_times(work, torch.device("cpu"), config, enough=enough)
    assert asked == [MIN_ROUNDS, 4] and all(len(t.samples_ms) == 4 for t in times.values())
    never = interleaved_times(work, torch.device("cpu"), config, enough=lambda s: False)
    assert all(len(t.samples_ms) == 9 for t in never.values())


def test_a_retired_callable_is_timed_no_more_its_rounds_stand_and_the_tests_see_the_others():
    order = []
    work = {name: (lambda n=name: order.append(n)) for name in "abc"}
    config = TimingConfig(warmup=0, rounds=6, min_block_s=0.0, warmup_s=0.0, min_steps=1)
    seen = []

    def enough(samples):
        seen.append(sorted(samples))
        return False

    times = interleaved_times(work, torch.device("cpu"), config, enough=enough, retire=lambda samples: {"b"})
    assert [len(times[n].samples_ms) for n in "abc"] == [6, 1, 6]  # b's one round stands beside the others' six
    assert order.count("b") == 1 + 1  # its sizing call and one round
    assert seen and all(names == ["a", "c"] for names in seen)  # the sequential test is about those still timed
    last = interleaved_times({"a": lambda: None}, torch.device("cpu"), config, retire=lambda samples: {"a"})
    assert len(last["a"].samples_ms) == 6  # never the last one: something is always timed to the end


def test_a_callable_that_raises_in_its_rounds_is_dropped_when_the_caller_takes_it_and_the_others_are_timed_on():
    """An out-of-memory error inside a timed round ended the whole search (issue 62, 3): with `drop`, the callable
    is timed no more (no Timing), the caller told with the error, and told of one retired too (to free it); `idle`
    after each block. Without `drop` the error ends the timing, as before."""
    calls = dict.fromkeys("abc", 0)

    def step(name):
        calls[name] += 1
        if name == "b" and calls[name] > 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.40 GiB")

    work = {name: (lambda n=name: step(n)) for name in "abc"}
    config = TimingConfig(warmup=0, rounds=6, min_block_s=0.0, warmup_s=0.0, min_steps=1)
    told, idle = [], []
    retire = lambda samples: {"c"} if len(samples["a"]) >= 2 else set()  # noqa: E731
    times = interleaved_times(work, torch.device("cpu"), config, retire=retire, idle=idle.append,
                              drop=lambda name, exc: told.append((name, type(exc).__name__ if exc else None)))  # fmt: skip
    assert sorted(times) == ["a", "c"] and len(times["a"].samples_ms) == 6 and len(times["c"].samples_ms) == 2
    assert told == [("c", None), ("b", "OutOfMemoryError")]  # c out of the running after two rounds; b's third raised
    assert idle.count("b") == 1 + 2 and idle.count("a") == 1 + 6  # after its sizing call and each block it finished
    calls["b"] = 0
    with pytest.raises(torch.OutOfMemoryError):
        interleaved_times(work, torch.device("cpu"), config)


def test_more_rounds_are_pooled_with_the_first_on_the_same_warm_callables_and_keep_the_rotation():
    order = []
    work = {name: (lambda n=name: order.append(n)) for name in "ab"}
    asked = []

    def more(samples):
        asked.append({n: len(v) for n, v in samples.items()})
        return 3

    times = interleaved_times(
        work, torch.device("cpu"), TimingConfig(warmup=2, rounds=3, min_block_s=0.0, warmup_s=0.0, min_steps=1), more=more
    )
    assert asked == [{"a": 3, "b": 3}]  # asked once, after the rounds
    assert all(len(t.samples_ms) == 6 for t in times.values())  # the extra rounds pooled with the first three
    assert order[4:] == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b", "b", "a"]  # no warm-up again; round 4 rotates on
    assert interleaved_times({}, torch.device("cpu"), TimingConfig(warmup=0, rounds=2), more=more) == {}
    none = interleaved_times(
        work, torch.device("cpu"), TimingConfig(warmup=0, rounds=2, min_block_s=0.0, warmup_s=0.0, min_steps=1), more=lambda s: 0
    )
    assert all(len(t.samples_ms) == 2 for t in none.values())


def test_more_rounds_only_when_a_spread_is_too_wide_to_rank(caplog):
    from autoprec.tune._core._config import NOISY_SPREAD
    from autoprec.tune._measure._timing import more_if_noisy, noisiest

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

    times = interleaved_times(work, torch.device("cpu"), TimingConfig(warmup=0, rounds=4, min_block_s=0.0, warmup_s=0.0, min_steps=1),
                              enough=lambda s: enough(s) and len(s["a"]) > 4, more=lambda s: 10)  # fmt: skip
    assert len(times["a"].samples_ms) == 6 and asked == [3, 5, 6]  # not asked at the first pass's last round


def test_the_final_remeasure_is_settled_once_every_candidates_rounds_agree_and_not_before_five():
    from autoprec.tune._core._config import SETTLED_FINAL_ROUNDS
    from autoprec.tune._measure._timing import all_settled

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
    assert (
        len(calls) == 3 and seconds.seconds >= 0.03 and seconds.host_s is None
    )  # a lower bound only: a busy machine takes longer, never shorter


def test_every_step_time_is_read_through_the_clock(monkeypatch):
    # interleaved_times: the sizing call, then a block per round, each priced by the clock and per step
    monkeypatch.setattr(timing, "CLOCK", ScriptedClock([0.001] + [0.004, 0.002, 0.003]))
    t = interleaved_times(
        {"x": lambda: None}, torch.device("cpu"), TimingConfig(warmup=1, rounds=3, min_block_s=0.0, warmup_s=0.0, min_steps=1)
    )
    assert t["x"].samples_ms == pytest.approx((4.0, 2.0, 3.0)) and t["x"].median_ms == pytest.approx(3.0)


def test_every_callable_takes_the_same_steps_in_every_round_enough_for_the_fastest_at_least_the_minimum_within_the_cap(
    monkeypatch,
):
    """A time budget's re-measure timed fp16 on 9 steps beside fp32's 254 and wrote it 22x faster (issue 37, 5): block
    sizes came from each candidate's own warm-up. One block size for all: the fastest's block lasts min_block_s, no
    sample averages fewer than min_steps, and the slowest's block stays within max_block_s."""
    calls: dict[str, list[int]] = {}

    class Clock:
        def time(self, work, n, device):
            calls[work.name].append(n)
            return work.seconds * n

    class Work:
        def __init__(self, name, seconds):
            self.name, self.seconds = name, seconds
            calls[name] = []

        def __call__(self):
            return None

    monkeypatch.setattr(timing, "CLOCK", Clock())
    config = TimingConfig(warmup=1, rounds=4, min_block_s=0.05, max_steps_per_block=50, warmup_s=0.0)
    interleaved_times({"fast": Work("fast", 0.001), "slow": Work("slow", 0.02)}, torch.device("cpu"), config)
    assert calls["fast"][1:] == calls["slow"][1:] == [50] * 4  # ceil(0.05 / 0.001), within max_block_s (2 s / 0.02)
    interleaved_times({"fast": Work("fast", 0.001), "slow": Work("slow", 0.1)}, torch.device("cpu"), config)
    assert calls["fast"][1:] == calls["slow"][1:] == [20] * 4  # the slowest's block within max_block_s: 2 s / 0.1
    interleaved_times({"fast": Work("fast", 0.1), "slow": Work("slow", 0.2)}, torch.device("cpu"), config)
    assert calls["fast"][1:] == calls["slow"][1:] == [MIN_STEPS_PER_SAMPLE] * 4  # 0.05 s / 0.1 is 1: the minimum wins
    interleaved_times({"fast": Work("fast", 0.1), "slow": Work("slow", 0.5)}, torch.device("cpu"), config)
    assert calls["fast"][1:] == calls["slow"][1:] == [4] * 4  # a step of half a second: 2 s of it, below the minimum


class AsyncWork:
    """A step on a device with a queue of its own: `host_s` to issue it, `device_s` for the device to run it."""

    def __init__(self, host_s, device_s):
        self.host_s, self.device_s = host_s, device_s

    def __call__(self):
        return None


@pytest.fixture
def queued_device():
    def price(work):  # the held block (Timing.busy_ms) wraps the work in a Step
        work = getattr(work, "run", work)
        return work.host_s, work.device_s

    with timings.queued_cpu(price):
        yield


def test_a_device_with_a_queue_is_timed_by_its_own_clock_and_the_host_apart_and_a_host_bound_step_is_named(queued_device):
    config = TimingConfig(warmup=1, rounds=3, warmup_s=0.0, min_steps=8, busy=True)
    # a trial's timing (busy=False) pays no held block: its busy time is unknown, and so whether it is host-bound
    trial = interleaved_times(
        {"bf16": AsyncWork(host_s=0.028, device_s=0.0085)}, torch.device("cpu"), TimingConfig(warmup=1, rounds=3, warmup_s=0.0)
    )
    assert trial["bf16"].busy_ms is None and not trial["bf16"].host_bound
    # GPT-2-small's bf16 step on an H200 (28.0 ms, the GPU busy 8.5 ms of it): the host issues for longer than the
    # GPU runs it
    bf16 = interleaved_times({"bf16": AsyncWork(host_s=0.028, device_s=0.0085)}, torch.device("cpu"), config)["bf16"]
    assert bf16.median_ms == pytest.approx(28.0) and bf16.host_ms == pytest.approx(28.0) and bf16.host_bound
    assert bf16.busy_ms == pytest.approx(8.5)
    # its fp32 step (54.5 ms, the GPU busy all of it): the host waits on the full launch queue for most of the step,
    # so its time is nearly the device's, and the step is still not host-bound (the host's time alone said it was)
    fp32 = interleaved_times({"fp32": AsyncWork(host_s=0.011, device_s=0.0545)}, torch.device("cpu"), config)["fp32"]
    assert fp32.median_ms == pytest.approx(54.5) and fp32.host_ms > 0.9 * fp32.median_ms
    assert fp32.busy_ms == pytest.approx(54.5) and not fp32.host_bound


def test_a_device_without_a_queue_gets_no_held_block_and_no_busy_time():
    """The CPU's steps run as they are issued: nothing to hold, so no block more is timed for the busy time."""
    clock = PricedClock()
    with timings.using(clock):
        t = interleaved_times({"a": Priced("a", 0.01)}, torch.device("cpu"), TimingConfig(warmup=1, rounds=3, warmup_s=0.0))
    assert t["a"].busy_ms is None and not t["a"].host_bound
    assert {name for name, _ in clock.blocks} == {"a"}  # a held Step has no name: PricedClock would fail on it


class PricedClock:
    """Every call of a work costs its `seconds`; each block's size and the collector's state inside it recorded."""

    def __init__(self):
        self.blocks: list[tuple[str, int]] = []
        self.collector: list[tuple[bool, int]] = []

    def time(self, work, calls, device):
        for _ in range(calls):
            work()
        self.blocks.append((work.name, calls))
        self.collector.append((gc.isenabled(), gc.get_freeze_count()))
        return work.seconds * calls


class Priced:
    def __init__(self, name, seconds):
        self.name, self.seconds = name, seconds

    def __call__(self):
        return None


def test_a_60_ms_step_is_sampled_over_at_least_eight_steps_and_the_final_remeasure_over_a_quarter_second(monkeypatch):
    """The first GPU run's final re-measure sampled one 56 ms fp32 step at a time (block sized from the slowest), so
    uniform bf16 beside it spread ±10%: every sample now averages MIN_STEPS_PER_SAMPLE steps or more."""
    from autoprec.tune._core._config import SearchConfig

    final = SearchConfig(budget=0.01).final_timing
    for config in (TimingConfig(), final):
        clock = PricedClock()
        monkeypatch.setattr(timing, "CLOCK", clock)
        interleaved_times({"fp32": Priced("fp32", 0.060), "bf16": Priced("bf16", 0.020)}, torch.device("cpu"), config)
        timed = clock.blocks[-2 * config.rounds :]
        assert all(steps >= MIN_STEPS_PER_SAMPLE == 8 for _, steps in timed)
        assert len({steps for _, steps in timed}) == 1  # timed together: the same steps
    assert all(steps * 0.020 >= final.min_block_s >= 0.25 for _, steps in timed)  # even the fastest's block


def test_the_collector_is_frozen_after_the_warm_up_and_off_inside_every_timed_block_and_restored_after(monkeypatch):
    clock = PricedClock()
    monkeypatch.setattr(timing, "CLOCK", clock)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    config = TimingConfig(warmup=1, rounds=3, min_block_s=0.0, warmup_s=0.0)
    interleaved_times({"a": Priced("a", 0.01), "b": Priced("b", 0.01)}, torch.device("cpu"), config)
    rounds = clock.collector[-6:]
    assert all(not enabled and frozen > 0 for enabled, frozen in rounds)
    assert gc.isenabled() and gc.get_freeze_count() == 0  # the process's collector as it was


def test_a_call_that_compiles_is_never_a_timed_one(monkeypatch):
    """torch.compile compiles a function again on its second value of an int (then treats it as dynamic): warm-up
    goes on past the configured calls while a call still compiles, so no timed block holds a compilation."""
    from autoprec.tune._measure._timing import compiled_graphs

    @torch.compile(backend="eager")
    def scale(x, n):
        return x * n

    x, n = torch.ones(4), iter(range(1, 1000))
    compiled = []

    class Clock:
        def time(self, work, calls, device):
            before = compiled_graphs()
            for _ in range(calls):
                work()
            compiled.append(compiled_graphs() != before)
            return 0.001 * calls

    monkeypatch.setattr(timing, "CLOCK", Clock())
    config = TimingConfig(warmup=1, rounds=3, min_block_s=0.0, warmup_s=0.0, min_steps=1)
    interleaved_times({"step": lambda: scale(x, next(n))}, torch.device("cpu"), config)
    assert any(compiled) and not any(compiled[-4:])  # the sizing call and the 3 rounds compiled nothing


def test_a_spread_is_written_as_stored_in_the_tables_the_first_line_and_the_warnings(caplog):
    """A stored spread of 5.12 (interquartile range over the median, as policy.json and the footnote define it) was
    printed `±256%`, half of it, by `show` and the summaries, and the noise warnings halved it too."""
    import types

    from builders import finals

    from autoprec import Policy
    from autoprec.tune._measure._timing import more_if_noisy, spread_text
    from autoprec.tune._report._results import headline
    from autoprec.tune._report._show import show_policy

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


def test_a_held_block_the_host_outran_leaves_the_busy_time_and_host_bound_unknown():
    """One call of more kernels than CUDA's launch queue holds outruns its hold (BlockTime.held False): its block's
    time includes the device's waits on the host, so it says nothing of the device's busy time."""
    from autoprec.devices import BlockTime

    class Outrun:
        def time(self, work, calls, device):
            for _ in range(calls):
                work()
            if getattr(work, "kernels", False):
                return BlockTime(calls * 0.030, calls * 0.029, held=False)
            return BlockTime(calls * 0.030, calls * 0.029)

    with timings.using(Outrun()):
        t = interleaved_times({"a": lambda: None}, torch.device("cpu"), TimingConfig(warmup=1, rounds=3, warmup_s=0.0, busy=True))
    assert t["a"].median_ms == pytest.approx(30.0) and t["a"].busy_ms is None and not t["a"].host_bound


def rated(speedup, spread):
    return types.SimpleNamespace(speedup=speedup, spread=spread)


def test_separated_needs_a_lead_beyond_the_mean_spread_whichever_comes_first():
    assert separated(rated(1.2, 0.1), rated(1.0, 0.1)) and separated(rated(1.0, 0.1), rated(1.2, 0.1))
    assert not separated(rated(1.05, 0.1), rated(1.0, 0.1))


def test_beaten_grants_each_side_half_the_wider_spread_and_at_least_settled():
    assert not beaten(1.85, 0.10, 2.0, 0.10)  # 1.85 * 1.05 reaches 2.0 / 1.05
    assert beaten(1.5, 0.10, 2.0, 0.10)
    assert not beaten(2.0 / (1 + SETTLED / 2) ** 2 + 1e-9, 0.0, 2.0, 0.0)  # a spread of 0 still counts as SETTLED


def test_may_beat_raises_the_prediction_by_the_fits_error_and_the_best_by_its_noise():
    assert may_beat(1.0, 0.10, 1.05, 0.04) and not may_beat(1.0, 0.10, 1.05, 0.05)
