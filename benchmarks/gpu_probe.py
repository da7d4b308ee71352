"""A GPU session's device calls: the Llama model searched, the CUDA tests, what GPT-2-small's step times are made of.

    python3 benchmarks/gpu_probe.py --out $OUT --stages search,d       # on the device machine: GPU_PLAN's first call
    python3 benchmarks/gpu_probe.py --out $OUT --stages c --deadline-s 185   # its second call, on the warm machine
    python3 benchmarks/gpu_probe.py --out /tmp/probe --smoke           # the same path on a CPU, tiny, minutes

Made for a device session of 15 minutes in all (a bare machine's start included): calls of at most about 9 minutes
(benchmarks/GPU_PLAN.md has the exact commands). Each stage checks the deadline before it starts and is given what
is left; each result is written under --out as soon as it is measured, so a call stopped at its limit still returns
what it had. The GPU is named from nvidia-smi and torch (an H100 or an H200: either is measured, the name goes with
every number). `--stages` picks the stages and their order (default: search, d, a, b; stage c only by name, and
never beside the search, whose final re-measure times the same candidates):

search. `autoprec search` on the Llama example (examples/llama, full size, its weights trained first) within the
   time left (--time-budget), whose finalists.csv holds its chosen policy beside uniform bf16, torchao's tensorwise
   and rowwise filters and the rest of the alternatives. c_search.tar.gz: its files, the trial log and the final
   re-measure's rounds so far among them, written as it goes, so a search stopped at the deadline keeps them.
d. The CUDA-only tests. d_tests.txt.
a. GPT-2-small (examples/gpt2, untrained weights: timing only), compiled fp32 and uniform bf16 (and, on CUDA, bf16
   under CUDA graphs, torch.compile's mode="reduce-overhead"): timed by the old clock (wall time between two
   synchronisations, one step a sample, as the first H200 run) and by autoprec's (the GPU's events over blocks of
   at least 8 steps, the host's issuing time apart, then one held block: the GPU's busy time), with each method's
   spread and whether the step is host-bound; then a torch.profiler table of 3 uniform-bf16 steps. a_gpt2.csv,
   a_gpt2.txt.
b. The fp8 shape sweep: benchmarks/fp8_linear.py, every Linear shape of GPT-2-small (M 4096) and of the Llama
   example (M 16384) in a bf16 root, bf16 against fp8, fp8-rowwise, fp8-fwd-dgrad. b_fp8_linear.csv.
c. The Llama example (untrained: timing only), compiled whole steps: uniform bf16, torchao's tensorwise fp8 on the
   Linears its size filter takes, the same for rowwise, fp8 on the FFN alone (gate, up and down projections), by
   autoprec's clock and, on CUDA, held (the GPU's busy time). c_llama.csv.

status.json says which stages finished, and the log (probe.log) holds everything printed. The wheels optuna and
torchao need (../shared/tools/device-wheels.sh fills .whl/ before the call) are installed from .whl/ when they are
not importable; without them the stages that need them say so and the others run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import gc
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's autoprec, whatever the working directory
SITE = Path("/tmp/site")  # where the carried wheels are installed
DEADLINE_S = 510.0  # the command's share of a 10-minute call limit, the transfers and a margin apart
# The least time a stage needs to be worth starting (seconds): its compilations mostly (GPU_PLAN.md prices them;
# stage a measured 105-120 s on the H200)
NEEDS = {"a": 125.0, "b": 45.0, "c": 150.0, "search": 150.0, "d": 30.0}
# GPU_PLAN's first call, then what time is left for. Stage c only by name (GPU_PLAN's second call, --stages c): its
# candidates are the search's alternatives, timed in its final re-measure; alone, it also times their GPU busy time
DEFAULT_STAGES = ("search", "d", "a", "b")
B_MOST_S = 100.0  # the shape sweep's cap: the Llama stage and the search matter more


def ensure_packages(log: Callable[[str], None]) -> list[str]:
    """optuna and torchao importable, from the wheels carried in .whl/ where they are not; the names still missing."""
    missing = [name for name in ("optuna", "torchao") if not _importable(name)]
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if missing and wheels:
        log(f"installing {len(wheels)} carried wheels from .whl/ into {SITE} (missing: {', '.join(missing)})")
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
        pip = subprocess.run(
            [*cmd, "--upgrade", "--target", str(SITE), *map(str, wheels)], capture_output=True, text=True, check=False
        )
        log(f"pip exit {pip.returncode}{': ' + (pip.stdout + pip.stderr)[-2000:] if pip.returncode else ''}")
        sys.path.insert(0, str(SITE))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), str(ROOT), os.environ.get("PYTHONPATH")]))
        missing = [name for name in missing if not _importable(name)]
    if missing:
        log(
            f"MISSING: {', '.join(missing)} (not importable and not in .whl/): run `bash ../shared/tools/device-wheels.sh` "
            "in the checkout before the call and carry .whl; the stages that need them are skipped"
        )
    return missing


def _importable(name: str) -> bool:
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec(name) is not None


class Probe:
    """The run's output folder, log, deadline and status."""

    def __init__(self, out: Path, deadline_s: float, smoke: bool, order: list[str] | None = None):
        self.out, self.smoke = out, smoke
        self.order = order or list(DEFAULT_STAGES)  # the stages this call runs, in order
        self.start = time.time()
        self.until = self.start + deadline_s
        self.status: dict[str, dict] = {}
        out.mkdir(parents=True, exist_ok=True)
        self._log = (out / "probe.log").open("a", encoding="utf-8")

    def log(self, text: str) -> None:
        line = f"[{time.time() - self.start:6.1f} s] {text}"
        print(line, flush=True)
        self._log.write(line + "\n")
        self._log.flush()

    def left(self) -> float:
        return self.until - time.time()

    def after(self, name: str) -> float:
        """The seconds the stages after `name` need: what it leaves them."""
        return sum(NEEDS[later] for later in self.order[self.order.index(name) + 1 :])

    def stage(self, name: str, need: float, fn: Callable[[], str]) -> None:
        """Run stage `name` if at least `need` seconds are left (none needed in a smoke run); its note, time and
        state go to status.json at once."""
        if not self.smoke and self.left() < need:
            self.note(name, "skipped", f"{self.left():.0f} s left, it needs about {need:.0f} s")
            return
        t0 = time.time()
        self.log(f"stage {name}: start ({self.left():.0f} s left)")
        try:
            text = fn()
            self.note(name, "complete", text, time.time() - t0)
        except Exception as exc:  # a stage's failure is a finding; the next stage still runs
            self.log(traceback.format_exc())
            self.note(name, "failed", f"{type(exc).__name__}: {exc}", time.time() - t0)

    def note(self, name: str, state: str, text: str, wall_s: float | None = None) -> None:
        self.status[name] = {"state": state, "note": text, "wall_s": None if wall_s is None else round(wall_s, 1)}
        self.log(f"stage {name}: {state}: {text}")
        (self.out / "status.json").write_text(json.dumps(self.status, indent=2) + "\n", encoding="utf-8")


def gpu_name() -> str:
    """The GPU as nvidia-smi and torch name it (or the CPU's name where there is none)."""
    import torch  # noqa: PLC0415

    parts = []
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=False,
        )  # fmt: skip
        if smi.stdout.strip():
            parts.append(f"nvidia-smi: {smi.stdout.strip()}")
    except (OSError, subprocess.TimeoutExpired):
        pass
    if torch.cuda.is_available():
        parts.append(f"torch: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})")
    else:
        from autoprec.devices import CPU  # noqa: PLC0415

        parts.append(CPU.name(torch.device("cpu")))
    return "; ".join(parts)


@contextlib.contextmanager
def model_size(variable: str, size: str) -> Iterator[None]:
    """An example's size variable set while its model.py is loaded (it reads it at import)."""
    before = os.environ.get(variable)
    os.environ[variable] = size
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = before


def workload_of(path: Path, variable: str, size: str, model_class: str, device):  # type: ignore[no-untyped-def]
    """A Workload of an example with untrained (seeded) weights: its step time does not depend on them, and training
    the full-size models would cost the call minutes."""
    import torch  # noqa: PLC0415

    from autoprec.tensors import map_tensors  # noqa: PLC0415
    from autoprec.tune import load_task  # noqa: PLC0415
    from autoprec.tune._measure._task import Workload  # noqa: PLC0415

    with model_size(variable, size):
        task = load_task(path)
    module = sys.modules[task.build_model.__module__]
    torch.manual_seed(0)
    model = getattr(module, model_class)().to(device)
    train = [map_tensors(b, lambda t: t.to(device)) for b in task.batches("train")]
    return Workload(task=task, device=device, model=model, train=train, eval=[]), module


class WallClock:
    """The clock of the first GPU run: wall time between two synchronisations, around the whole block."""

    def time(self, work, calls, device):  # type: ignore[no-untyped-def]
        from autoprec.tune._measure._timing import synchronize  # noqa: PLC0415

        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            work()
        synchronize(device)
        return time.perf_counter() - start


def trainers(workload, candidates: dict, compiled: bool, log, graphs: tuple[str, ...] = ()) -> dict:  # type: ignore[no-untyped-def]
    """name -> a warm Trainer (built, compiled, stepped on every batch shape); a candidate that fails is logged and
    left out. `graphs`: names whose model is compiled with mode="reduce-overhead" (CUDA graphs) instead."""
    from autoprec.apply import repeated_blocks  # noqa: PLC0415
    from autoprec.tune._measure._trainer import Trainer  # noqa: PLC0415

    out = {}
    for name, candidate in candidates.items():
        t0 = time.time()
        try:
            if name in graphs:  # a diagnostic, not a format: each block compiled as compile_model does, CUDA graphs on
                trainer = Trainer(workload, candidate)
                for block in repeated_blocks(trainer.model):
                    block.compile(mode="reduce-overhead")
                for _ in range(2):  # CUDA graphs record on a later call than the first: these steps are not timed
                    trainer.step()
            else:
                trainer = Trainer(workload, candidate, compiled=compiled)
            trainer.step()
            trainer.warm_shapes()
            out[name] = trainer
            log(f"  {name}: built and warm in {time.time() - t0:.1f} s")
        except Exception as exc:
            log(f"  {name}: FAILED to build or step: {type(exc).__name__}: {str(exc)[:300]}")
    return out


def timed_rows(stage: str, model: str, method: str, work: dict, device, config, clock=None, held: bool = False) -> list[dict]:  # type: ignore[no-untyped-def]
    """Time `work` (warm Trainers) interleaved (under `clock` where given, else autoprec's) and one row per
    candidate. `held`: the GPU's busy time alone (Step.kernels: the stream held while the host queues each block),
    against which the unheld time shows how long the GPU waited on the host."""
    from autoprec.tune._measure import _timing as timing  # noqa: PLC0415

    before = {name: w.steps for name, w in work.items()}
    steps = {name: timing.Step(w.step, w.model, kernels=True) for name, w in work.items()} if held else work
    saved = timing.CLOCK
    if clock is not None:
        timing.CLOCK = clock
    try:
        times = timing.interleaved_times(steps, device, config)
    finally:
        timing.CLOCK = saved
    rows = []
    for name, t in times.items():
        rounds = len(t.samples_ms)
        rows.append({
            "stage": stage, "model": model, "candidate": name, "method": method, "median_ms": round(t.median_ms, 4),
            "spread": round(t.spread, 4), "host_ms": None if t.host_ms is None else round(t.host_ms, 4),
            "busy_ms": None if t.busy_ms is None else round(t.busy_ms, 4),
            "host_bound": t.host_bound, "rounds": rounds, "steps_timed": work[name].steps - before[name],
            "samples_ms": " ".join(f"{s:.4f}" for s in t.samples_ms),
        })  # fmt: skip
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    if rows:
        with path.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def show(rows: list[dict], log) -> None:  # type: ignore[no-untyped-def]
    from autoprec.tune._measure._timing import spread_text  # noqa: PLC0415

    for r in rows:
        host = "" if r["host_ms"] is None else f", host {r['host_ms']:.3f} ms{' HOST-BOUND' if r['host_bound'] else ''}"
        log(f"  {r['model']:>6} {r['method']:>10} {r['candidate']:>28}: {r['median_ms']:9.3f} ms spread {spread_text(r['spread'])}{host} "
            f"({r['rounds']} rounds, {r['steps_timed']} steps)")  # fmt: skip


def configs(smoke: bool):  # type: ignore[no-untyped-def]
    """(the old method's TimingConfig, autoprec's): the first H200 run's final re-measure (11 rounds, blocks sized
    from the slowest: one step), and today's final re-measure with the GPU's busy time measured after its rounds, as
    the search's is (TimingConfig.busy), so a row says whether its step is host-bound."""
    from autoprec.tune._core._config import SearchConfig, TimingConfig  # noqa: PLC0415

    if smoke:
        tiny = TimingConfig(warmup=1, rounds=2, min_block_s=0.0, warmup_s=0.0, min_steps=1)
        return tiny, dataclasses.replace(tiny, busy=True)
    old = TimingConfig(warmup=3, rounds=11, min_block_s=0.05, max_block_s=0.05, min_steps=1, warmup_s=0.0)
    return old, dataclasses.replace(SearchConfig(budget=0.02).final_timing, busy=True)


def stage_a(probe: Probe, device) -> str:  # type: ignore[no-untyped-def]
    import torch  # noqa: PLC0415

    from autoprec import Policy  # noqa: PLC0415
    from autoprec.tune._core._records import Candidate  # noqa: PLC0415
    from autoprec.tune._measure._trainer import compile_scope  # noqa: PLC0415

    cuda = device.type == "cuda"
    workload, _ = workload_of(
        ROOT / "examples/gpt2/model.py", "AUTOPREC_GPT2_SIZE", "tiny" if probe.smoke else "small", "GPT", device
    )
    candidates = {"fp32": Candidate(Policy(layers={"": "fp32"})), "uniform bf16": Candidate(Policy(layers={"": "bf16"}))}
    graphs = ("uniform bf16, CUDA graphs",) if cuda else ()
    candidates.update(dict.fromkeys(graphs, candidates["uniform bf16"]))
    old, new = configs(probe.smoke)
    rows: list[dict] = []
    with compile_scope(True, len(candidates)):
        # compiled as a GPU trains; the smoke eager (inductor's CPU compiles take minutes on a small machine)
        warm = trainers(workload, candidates, compiled=not probe.smoke, log=probe.log, graphs=graphs)
        for method, config, clock in (("old clock", old, WallClock()), ("autoprec", new, None)):
            rows += timed_rows("a", "gpt2", method, warm, device, config, clock)
            write_csv(probe.out / "a_gpt2.csv", rows)
        if cuda:  # the GPU's busy time: beside the unheld time, how long the GPU waited on the host
            try:
                rows += timed_rows("a", "gpt2", "held", warm, device, dataclasses.replace(new, rounds=5), held=True)
                write_csv(probe.out / "a_gpt2.csv", rows)
            except Exception:  # a finding; the profiler table below still runs
                probe.log("held timing FAILED:\n" + traceback.format_exc())
        show(rows, probe.log)
        text = io.StringIO()
        if "uniform bf16" in warm:
            from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                for _ in range(3):
                    warm["uniform bf16"].step()
                if cuda:
                    torch.cuda.synchronize()
            averages = prof.key_averages()
            for sort in ("cuda_time_total", "device_time_total") if cuda else ("cpu_time_total",):
                try:
                    text.write(averages.table(sort_by=sort, row_limit=40))
                    break
                except (AttributeError, KeyError, ValueError):
                    continue
    (probe.out / "a_gpt2.txt").write_text(
        "GPT-2-small, 3 compiled uniform-bf16 steps under torch.profiler\n\n" + text.getvalue(), encoding="utf-8"
    )
    bound = [f"{r['candidate']} ({r['method']})" for r in rows if r["host_bound"]]
    return f"{len(rows)} timings; host-bound: {', '.join(bound) or 'none'}"


def run_logged(cmd: list[str], timeout: float | None, **kwargs) -> tuple[int | None, str]:  # type: ignore[no-untyped-def]
    """`cmd`'s exit status (None: stopped at `timeout`) and its output, kept when it is stopped too (the first
    run's stopped stages lost theirs)."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
        return proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        parts = (exc.stdout, exc.stderr)
        return None, "".join(p.decode(errors="replace") if isinstance(p, bytes) else (p or "") for p in parts)


def stage_b(probe: Probe, device) -> str:  # type: ignore[no-untyped-def]
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks/fp8_linear.py"),
        "--device",
        str(device),
        "--csv",
        str(probe.out / "b_fp8_linear.csv"),
        "--models",
        "llama,gpt2",  # the headline model's shapes first: the sweep may be stopped at its cap
        "--rounds",
        "5",
    ]
    if probe.smoke:
        cmd.append("--smoke")
    probe.log("$ " + " ".join(cmd))
    # leave the Llama stage and the search their time
    timeout = None if probe.smoke else max(5.0, min(B_MOST_S, probe.left() - probe.after("b")))
    rc, output = run_logged(cmd, timeout)
    probe.log(output)
    if rc is None:
        return (
            f"stopped after {timeout:.0f} s to leave the Llama stage and the search their time (the rows measured are in the csv)"
        )
    return f"exit {rc}"


def stage_c(probe: Probe, device) -> str:  # type: ignore[no-untyped-def]
    from autoprec import Policy  # noqa: PLC0415
    from autoprec.tune._core._records import Candidate  # noqa: PLC0415
    from autoprec.tune._decide._alternatives import torchao_fp8_layers  # noqa: PLC0415
    from autoprec.tune._measure._trainer import compile_scope  # noqa: PLC0415

    workload, _ = workload_of(
        ROOT / "examples/llama/model.py", "AUTOPREC_LLAMA_SIZE", "tiny" if probe.smoke else "full", "Llama", device
    )
    model = workload.model
    bf16: dict[str, str] = {"": "bf16"}
    candidates = {"uniform bf16": Candidate(Policy(layers=bf16))}
    for recipe, fmt in (("tensorwise", "fp8"), ("rowwise", "fp8-rowwise")):
        try:
            layers, n = torchao_fp8_layers(model, device, recipe)
        except Exception as exc:  # no torchao, or one without the filter
            probe.log(f"  torchao {recipe}: not measured: {type(exc).__name__}: {exc}")
            continue
        probe.log(f"  torchao {recipe} filter: {len(layers)} of {n} Linears")
        if layers:
            candidates[f"torchao {recipe} (filter)"] = Candidate(Policy(layers={**bf16, **dict.fromkeys(layers, fmt)}))
    ffn = [name for name, m in model.named_modules() if ".mlp." in f"{name}." and name.endswith("_proj")]
    candidates["fp8 FFN only"] = Candidate(Policy(layers={**bf16, **dict.fromkeys(ffn, "fp8")}))
    _, new = configs(probe.smoke)
    with compile_scope(True, len(candidates)):
        warm = trainers(workload, candidates, compiled=not probe.smoke, log=probe.log)
        rows = timed_rows("c", "llama", "autoprec", warm, device, new)
        write_csv(probe.out / "c_llama.csv", rows)  # saved before the held rounds, which a deadline may cut
        # the GPU's busy time of each candidate: the predictor prices the GPU's work, and its largest held-out error
        # (issue 61, the tensorwise filter here) is against steps whose host issues them in nearly as long
        if device.type == "cuda":
            try:
                rows += timed_rows("c", "llama", "held", warm, device, dataclasses.replace(new, rounds=5), held=True)
            except Exception:  # a finding; the unheld rows stand
                probe.log("held timing FAILED:\n" + traceback.format_exc())
    write_csv(probe.out / "c_llama.csv", rows)
    show(rows, probe.log)
    del warm  # the search below builds its own models: free these first
    timed = [r for r in rows if r["method"] == "autoprec"]  # the steps as training runs them, not the busy times
    base = next((r["median_ms"] for r in timed if r["candidate"] == "uniform bf16"), None)
    best = min(timed, key=lambda r: r["median_ms"]) if timed else None
    text = f"{len(timed)} candidates timed" + (
        f"; fastest {best['candidate']}, {base / best['median_ms']:.3f}x uniform bf16" if best and base else ""
    )
    return text


def stage_search(probe: Probe, device) -> str:  # type: ignore[no-untyped-def]
    """`autoprec search` on the Llama example within the time left (its weights train first, about a minute)."""
    import torch  # noqa: PLC0415

    gc.collect()  # the Llama stage's four models, their graphs and optimizer states: freed before the search's own
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    from gpu_suite import GPU_SPACE  # noqa: PLC0415 (the GPU suite's space: one place says what a GPU search offers)

    folder = Path(tempfile.mkdtemp(prefix="probe-search-"))  # its files travel back packed, in c_search.tar.gz
    # the smoke's Linears in fp32 or fp8 only, as the suite's smoke: the path, not the choice
    space = {**GPU_SPACE, "layers": {"Linear": ["fp32", "fp8"]}} if probe.smoke else GPU_SPACE
    (folder / "space.yaml").write_text(json.dumps(space), encoding="utf-8")  # JSON is YAML
    minutes = 1.0 if probe.smoke else max(1.0, (probe.left() - probe.after("search") - 60) / 60 * 0.7)
    cmd = [sys.executable, "-m", "autoprec", "search", str(ROOT / "examples/llama/model.py"), "--budget", "0.02",
           "--time-budget", f"{minutes:.1f}", "--out", str(folder), "--device", str(device),
           "--space", str(folder / "space.yaml")]  # fmt: skip
    if probe.smoke:
        cmd += ["--trials", "2"]
    env = {**os.environ, "AUTOPREC_LLAMA_SIZE": "tiny" if probe.smoke else "full", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(SITE) if SITE.is_dir() else "", str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    probe.log("$ " + " ".join(cmd))
    timeout = None if probe.smoke else max(10.0, probe.left() - probe.after("search"))
    rc, output = run_logged(cmd, timeout, env=env)
    # the progress bars' carriage-return frames dropped: their last state and every other line kept
    probe.log("\n".join(line.rsplit("\r", 1)[-1] for line in output.splitlines())[-8000:])
    result = f"stopped after {timeout:.0f} s" if rc is None else f"exit {rc}"
    pack_search(folder, probe.out / "c_search.tar.gz")
    return result


# What a search writes that the probe brings back; a search stopped at the deadline has written its profile, its
# trial log (trials.csv after each trial, the study's journal) and its final re-measure's rounds so far
SEARCH_FILES = ("summary.md", "finalists.csv", "finalists.partial.csv", "trials.csv", "study.journal", "profile.csv",
                "profile.json", "policy.json", "space.yaml")  # fmt: skip


def pack_search(folder: Path, tar_path: Path) -> None:
    """The search's files in `folder` (SEARCH_FILES, those there) into `tar_path`, under search-llama/."""
    with tarfile.open(tar_path, "w:gz") as tar:
        for name in SEARCH_FILES:
            if (folder / name).is_file():
                tar.add(folder / name, arcname=f"search-llama/{name}")


def stage_d(probe: Probe, device) -> str:  # type: ignore[no-untyped-def]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_apply.py", "tests/test_apply_compile.py",
           "tests/test_schedule.py", "tests/test_devices.py", "-k", "cuda or kernels"]  # fmt: skip
    probe.log("$ " + " ".join(cmd))
    timeout = None if probe.smoke else max(5.0, probe.left() - probe.after("d"))
    # graph breaks and recompiles named: the first H200 run's compiled fp8 test made 6 graphs where the CPU makes 1
    env = {**os.environ, "TORCH_LOGS": "graph_breaks,recompiles"}
    rc, output = run_logged(cmd, timeout, env=env)
    (probe.out / "d_tests.txt").write_text(output, encoding="utf-8")
    if rc is None:
        return f"stopped after {timeout:.0f} s"
    return f"exit {rc}: {(output.strip().splitlines() or ['no output'])[-1]}"


def stages_named(text: str) -> list[str]:
    """--stages as the stages to run, in order; a ValueError saying why not (none, unknown, twice, or stage c beside
    the search, whose final re-measure times c's candidates)."""
    order = [name.strip() for name in text.split(",") if name.strip()]
    wrong = [name for name in order if name not in NEEDS]
    if not order or wrong:
        raise ValueError(f"--stages must name some of {', '.join(NEEDS)}, got {text!r}; e.g. --stages search,d")
    if len(set(order)) != len(order):
        raise ValueError(f"--stages must name each stage once, got {text!r}")
    if "c" in order and "search" in order:
        raise ValueError(
            "--stages: stage c times uniform bf16 and torchao's filters on the Llama model, which the search's final "
            "re-measure times beside its policy (finalists.csv): name one of them"
        )
    return order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/probe")), help="results folder (default: $OUT)"
    )
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="seconds the whole command may take")
    parser.add_argument("--smoke", action="store_true", help="every stage tiny, on this machine's CPU (no deadline)")
    parser.add_argument(
        "--stages",
        default=",".join(DEFAULT_STAGES),
        help=f"the stages to run, in this order, of {', '.join(NEEDS)} (default: {','.join(DEFAULT_STAGES)})",
    )
    args = parser.parse_args()
    if args.deadline_s <= 0:
        print(f"gpu_probe: --deadline-s must be a number of seconds > 0, got {args.deadline_s}", file=sys.stderr)
        raise SystemExit(2)
    try:
        order = stages_named(args.stages)
    except ValueError as exc:
        print(f"gpu_probe: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    probe = Probe(args.out, args.deadline_s, args.smoke, order)
    missing = ensure_packages(probe.log)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor-cache")  # one machine's graphs, reused by stage d
    import torch  # noqa: PLC0415

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    name = gpu_name()
    probe.log(f"device: {name}; torch {torch.__version__}; python {sys.version.split()[0]}")
    probe.status["device"] = {"state": "named", "note": name}
    if not args.smoke and device.type != "cuda":
        probe.log("no GPU here: the stages run on the CPU, and their numbers say nothing of a GPU's (use --smoke)")
    stages = {"a": stage_a, "b": stage_b, "c": stage_c, "search": stage_search, "d": stage_d}
    for name in order:
        if name == "search" and "optuna" in missing:
            probe.note("search", "skipped", "optuna is missing (see MISSING above)")
        else:
            probe.stage(name, NEEDS[name], lambda fn=stages[name]: fn(probe, device))
    probe.log(
        f"done in {time.time() - probe.start:.0f} s; files in {probe.out}: {', '.join(sorted(p.name for p in probe.out.iterdir()))}"
    )


if __name__ == "__main__":
    main()
