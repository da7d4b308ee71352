"""The GPU suite: everything autoprec must show on a GPU, in parts that each end inside one device call.

    python benchmarks/gpu_suite.py --gpu h100 --part <part>[,<part>...] [--pack $OUT]   # writes results/h100
    python benchmarks/gpu_suite.py --out DIR --smoke --device cpu                  # every part, tiny, on a CPU

--gpu names the GPU the command expects (h100 by default, h200 where only that is lent) and is refused on any
other, so results/<gpu>/ never mixes two devices' numbers; a tables part whose rows were timed on another device
times them all again.

On the device machine (one line, the wheels from ../shared/tools/device-wheels.sh carried in .whl/; see
benchmarks/GPU_PLAN.md for the calls of a session and what to do with what comes back):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 AUTOPREC_CACHE=/tmp/autoprec-cache || exit 1; python3 benchmarks/gpu_suite.py --gpu h100 --part tests,bench --pack $OUT

Parts, each writing under --out:

- `tests`: the test suite (its CUDA tests run only on a GPU) in chunks of test files, each chunk's output in
  tests/chunkNN.txt, all of them in tests.txt;
- `bench`: benchmarks/fp8_linear.py --compile (every fp8 recipe the device runs, against bf16) and benchmarks/overhead.py
  --compile, output in fp8_linear.txt and overhead.txt;
- `tinylm`, `gpt2`: a compiled `autoprec search` (budget 0.02 on -(mean eval loss)) of examples/tinylm and of
  examples/gpt2 (GPT-2-small class), each in search-<model>/ with its policy.json, trials, finalists and a
  summary.md, beside the alternatives measured in the same run (fp32, TF32, uniform bf16, torchao fp8
  everywhere with its filter, the profile-greedy policy);
- `tables-tinylm`, `tables-gpt2`: the device's timing tables for a search developed on a CPU (a replay), in
  tables-<model>/: layer_times.csv (each profiled layer's step time per format, with its spread: the search's profile,
  measured here and saved in search-<model>/ where the search has not run yet) and step_times.csv (whole training
  steps of fp32, uniform bf16 and --policies random per-layer policies drawn from the search's choices, each timed
  interleaved with a fresh fp32 baseline as a search's trial is, all rounds kept: trials.csv's columns, the samples
  of both and the formats per layer);
- `summary`: summary.md, one row per searched model from the search folders present (written after any part).

Deadlines and resuming. The parts listed run one after the other, each in a child process, and the whole command
ends within --deadline-s (default 480 s: an H100/H200 device call is 10 minutes, the machine's start and the
transfers apart). Each part plans with what is left: the tests and the tables stop before a chunk or a policy that
the ones before it say will not fit; a search gets a --time-budget of part of what is left (its trials stop where
the final re-measure still fits). A part still running at the deadline is stopped; status.json and the output say
which parts finished, which stopped and what they skipped. Run the same command again (on the same --out) and
each part resumes: finished test chunks, benchmarks and timed policies are kept (marker files), a search resumes
its Optuna study (study.journal) and reuses its saved profile, and a finished part is not run again.

--pack DIR writes what must come back into DIR as three files: suite.tar.gz (all of --out), summary.md and
status.json (the device returns at most 8 files from $OUT).

--smoke shrinks everything (gpt2 at AUTOPREC_GPT2_SIZE=tiny with Linears in fp32 or fp8 only, 2 trials, short
timing, the CUDA tests only, one small benchmark shape, 1 random policy in the tables; tinylm and its tables are left
out) so CI runs the whole path on a CPU; its numbers mean nothing. It has no deadline (unless --deadline-s is
given): its work is bounded by those sizes, so a loaded machine finishes it later, never less of it.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's autoprec, whatever the working directory

SEARCHES = ("tinylm", "gpt2")
PARTS = ("tests", "bench", *SEARCHES, *(f"tables-{m}" for m in SEARCHES))
SMOKE_LEFT_OUT = ("tinylm", "tables-tinylm")  # tinylm is not tiny; gpt2 tiny stands for both models
MODELS = {"tinylm": ROOT / "examples" / "tinylm" / "model.py", "gpt2": ROOT / "examples" / "gpt2" / "model.py"}
BUDGET = 0.02
TRIALS = {"tinylm": 24, "gpt2": 16}  # what fits a device call on an H100 is the goal; --trials overrides
POLICIES = 12  # random policies per model in the tables (beside fp32 and uniform bf16); --policies overrides
DEADLINE_S = 480.0
# The suite searches fewer formats than the default space: fp32 and bf16 roots; Linears in fp32, bf16, the two fp8
# recipes and the per-GEMM mix the published rooflines favour where wgrad's small GEMMs lose (fp8-fwd-dgrad).
# Every format of every Linear shape is a compiled graph in the profile and per block policy in the trials, which on
# the device's 10-minute calls is the budget (benchmarks/compile_count.py counts them; GPU_PLAN.md prices them).
GPU_SPACE = {"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16", "fp8", "fp8-rowwise", "fp8-fwd-dgrad"]}}
SEARCH_SHARE = 0.7  # of the time left, a search's --time-budget: its final re-measure compiles beyond its budget
TEST_CHUNK = 8  # test files per pytest process: a killed part loses one chunk, not the suite
MARGIN = 1.25  # a chunk or policy starts only where the slowest before it, times this, still fits
SHARE = {"tests": 2.0}  # a part's weight when parts share a command's time (the others: 1); what one leaves, the next gets
PACK_WARN = 15 * 2**20
GPUS = {
    "h100": "H100",
    "h200": "H200",
}  # --gpu: the name torch.cuda.get_device_name must contain  # the device returns files of at most 16 MiB
import torch  # noqa: E402

from autoprec.formats import default_device  # noqa: E402
from autoprec.tune._core._names import BF16, FP8_EVERYWHERE, FP8_ROWWISE_EVERYWHERE, FP32, TF32  # noqa: E402
from autoprec.tune._core._records import Measured  # noqa: E402

COLUMNS = (FP32, TF32, BF16, FP8_EVERYWHERE, FP8_ROWWISE_EVERYWHERE)  # the uniform choices a user would otherwise make


def left(until: float) -> float:
    return until - time.time()


def wait_s(until: float, extra: float = 0.0) -> float | None:
    """A subprocess timeout that ends at `until` (at least a second), or None where there is no deadline (--smoke)."""
    return None if math.isinf(until) else max(1.0, left(until) + extra)


def note(out: Path, part: str, *, complete: bool, text: str) -> None:
    """What a part (in its child process) says about itself: status/<part>.json, merged into status.json."""
    (out / "status").mkdir(exist_ok=True)
    (out / "status" / f"{part}.json").write_text(json.dumps({"complete": complete, "note": text}) + "\n", encoding="utf-8")
    print(f"gpu_suite: {part}: {text}", flush=True)


def run(cmd: list[str], out: Path, *, timeout: float | None = None) -> int | None:
    """Run a command from the repository root with its output in `out` (and its end echoed); None when it ran past
    `timeout` seconds and was stopped."""
    print("$", " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        out.write_text(f"$ {' '.join(cmd)}\n\nstopped after {timeout:.0f} s (the deadline)\n{text}", encoding="utf-8")
        return None
    text = proc.stdout + proc.stderr
    out.write_text(f"$ {' '.join(cmd)}\n\n{text}", encoding="utf-8")
    print(text[-3000:], flush=True)
    return proc.returncode


def part_tests(out: Path, args: argparse.Namespace, until: float) -> int:
    # this suite's own smoke test would run the suite again inside this piece: left to CI
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if args.smoke:  # the CUDA tests (they skip on a CPU), not the whole suite CI has just run
        chunks = [["tests/test_apply.py", "tests/test_apply_compile.py", "-k", "cuda or kernels"]]
    else:
        files = sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_gpu_suite.py")
        chunks = [files[i : i + TEST_CHUNK] for i in range(0, len(files), TEST_CHUNK)]
    folder = out / "tests"
    folder.mkdir(exist_ok=True)
    status, slowest, skipped, ran = 0, 0.0, [], 0
    for i, chunk in enumerate(chunks):
        log_file, marker = folder / f"chunk{i:02d}.txt", folder / f"chunk{i:02d}.rc"
        if marker.is_file():  # finished in an earlier run of this command
            status |= int(marker.read_text() or 1) not in (0, 5)
            continue
        if skipped or left(until) < MARGIN * slowest:
            skipped.append(i)
            continue
        start = time.time()
        rc = run(base + chunk, log_file, timeout=wait_s(args._until))  # the hard deadline: resumable
        slowest = max(slowest, time.time() - start)
        if rc is None:
            skipped.append(i)
            continue
        marker.write_text(str(rc))
        status |= rc not in (0, 5)  # 5: no test collected (-k on a chunk without CUDA tests)
        ran += 1
    logs = [(folder / f"chunk{i:02d}.txt") for i in range(len(chunks))]
    (out / "tests.txt").write_text("\n\n".join(p.read_text(encoding="utf-8") for p in logs if p.is_file()), encoding="utf-8")
    done = len(chunks) - len(skipped)
    text = f"{done} of {len(chunks)} test chunks done ({ran} in this run)" + (
        f"; not run: chunks {', '.join(map(str, skipped))} (the deadline): run the same command again" if skipped else ""
    )
    note(out, "tests", complete=not skipped, text=text)
    return status


def part_bench(out: Path, args: argparse.Namespace, until: float) -> int:
    fp8 = [sys.executable, "benchmarks/fp8_linear.py", "--compile", "--device", args.device]
    over = [sys.executable, "benchmarks/overhead.py", "--compile", "--device", args.device]
    if args.smoke:
        fp8 += ["--smoke", "--rounds", "1"]
        over += ["--width", "32", "--depth", "1", "--rounds", "1"]
    status, skipped = 0, []
    for name, cmd in (("fp8_linear", fp8), ("overhead", over)):
        marker = out / f"{name}.rc"
        if marker.is_file():
            status |= int(marker.read_text() or 1) != 0
            continue
        rc = run(cmd, out / f"{name}.txt", timeout=wait_s(args._until)) if left(args._until) > 5 else None
        if rc is None:
            skipped.append(name)
            continue
        marker.write_text(str(rc))
        status |= rc != 0
    text = "fp8_linear and overhead done" if not skipped else f"not finished: {', '.join(skipped)} (the deadline)"
    note(out, "bench", complete=not skipped, text=text)
    return status


def search_settings(name: str, args: argparse.Namespace, time_budget: float | None = None):  # type: ignore[no-untyped-def]
    """The search's space and settings, shared by the search part and the tables (whose profile is the search's)."""
    from autoprec.tune import SearchConfig
    from autoprec.tune._core._config import ProfileConfig, TimingConfig
    from autoprec.tune._core._space import space_from_dict

    trials = args.trials or (2 if args.smoke else TRIALS[name])
    extra: dict[str, object] = {}
    # the suite's space (GPU_SPACE): each format more is a compiled graph per distinct block policy (GPU_PLAN.md)
    space = space_from_dict({**GPU_SPACE, "trials": trials})
    if args.smoke:  # every compile costs seconds on a CPU: fewer formats, trials and rounds
        tiny = TimingConfig(warmup=1, rounds=2, min_block_s=0.0)
        extra = dict(timing=tiny, final_timing=tiny, finalists=1, profile=ProfileConfig(batches=1, timing=tiny))
        space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "fp8"]}, "trials": trials})
    config = SearchConfig(budget=BUDGET, trials=trials, compile=True, progress=not args.smoke, time_budget=time_budget, **extra)
    return space, config


def workload_of(name: str, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The model's workload on the device (the example's weights trained on first use: minutes for gpt2)."""
    if args.smoke:
        os.environ["AUTOPREC_GPT2_SIZE"] = "tiny"  # read when model.py is imported, just below
    from autoprec.tune import load_task, prepare

    start = time.time()
    workload = prepare(load_task(MODELS[name]), torch.device(args.device))
    print(f"gpu_suite: {name}: model ready in {time.time() - start:.0f} s", flush=True)
    return workload


def part_search(name: str, out: Path, args: argparse.Namespace, until: float) -> int:
    from autoprec.files import write_text
    from autoprec.tune._api import search_and_report

    folder = out / f"search-{name}"
    workload = workload_of(name, args)
    budget_s = max(30.0, SEARCH_SHARE * left(until))
    space, config = search_settings(name, args, time_budget=None if args.smoke else budget_s)
    # A fresh machine trains the example's weights again (on a GPU, not bit for bit): one study per weights digest, so
    # a machine with the same weights resumes it and one with other weights starts its own instead of being refused.
    config = dataclasses.replace(config, study_name=f"{name}-{workload.weights}")
    if not args.smoke:  # the profile may take most of the part (not half of --time-budget): it is kept for the next call
        config = dataclasses.replace(config, profile=dataclasses.replace(config.profile, deadline_s=max(0.0, 0.9 * left(until))))
    limit = "no --time-budget (smoke)" if args.smoke else f"--time-budget {budget_s / 60:.1f} min"
    print(f"gpu_suite: {name}: {config.trials} trials, {limit}, {left(until):.0f} s this part's share of the time left",
          flush=True)  # fmt: skip
    command = f"python benchmarks/gpu_suite.py --out {args.out} --part {name}" + (" --smoke" if args.smoke else "")
    start = time.perf_counter()
    result = search_and_report(workload, space, config, folder, command=command)
    wall = time.perf_counter() - start  # the reports' drawing included: a second or two beside the search
    measured = Measured.of(result.policy)
    complete_trials = int((result.trials["state"] == "COMPLETE").sum()) if "state" in result.trials else 0
    stopped = measured.stopped or ""
    complete = complete_trials >= config.trials or (bool(stopped) and "time budget" not in stopped)
    row = {"model": name + (" (tiny)" if args.smoke and name == "gpt2" else ""), "wall_s": wall, "trials": complete_trials,
           "complete": complete, "chosen": measured.chosen, "device": result.profile.device,
           "finals": json.loads(result.finals.to_frame().to_json(orient="records"))}  # fmt: skip
    write_text(folder / "result.json", json.dumps(row, indent=2) + "\n")
    text = f"chose {row['chosen']} in {wall:.0f} s ({complete_trials} of {config.trials} trials)" + (
        "" if complete else f"; {stopped or 'stopped early'}: run the same command again for the rest"
    )
    note(out, name, complete=complete, text=text)
    return 0


STEP_FIELDS = ("trial", "policy", "state", "step_ms", "skipped", "steps", "effective_step_ms", "fp32_step_ms", "speedup",
               "spread", "policy_spread", "fp32_spread", "rounds", "compile_s", "measure_s", "error", "samples_ms",
               "fp32_samples_ms")  # fmt: skip
LAYER_FIELDS = ("layer", "type", "shape", "format", "status", "reason", "time_ms", "time_spread", "time_vs_fp32", "timed_as")


def table_policies(choices, n: int, seed: int = 0) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """fp32, uniform bf16 (a bf16 root where the choices allow it) and `n` policies with a random root and random
    per-layer formats from the search's choices, by name; seeded, so a rerun draws the same ones."""
    from autoprec.policy import ROOT, Policy
    from autoprec.tune._measure._choices import uniform_layers

    bf16_root = "bf16" if "bf16" in choices.default else "fp32"
    out = {
        "fp32": Policy(layers={ROOT: "fp32", **uniform_layers(choices, "fp32")}),  # every layer named, as trials.csv
        "uniform bf16": Policy(layers={ROOT: bf16_root, **uniform_layers(choices, "bf16")}),
    }
    rng = random.Random(seed)
    seen = {formats_of(p) for p in out.values()}
    for _ in range(20 * n + 20):  # a small space has fewer distinct policies than asked for
        if len(out) >= n + 2:
            break
        layers = {name: rng.choice(options) for name, options in choices.layers.items()}
        policy = Policy(layers={ROOT: rng.choice(choices.default), **layers})
        if formats_of(policy) not in seen:
            seen.add(formats_of(policy))
            out[f"random {len(out) - 1}"] = policy
    return out


def formats_of(policy) -> str:  # type: ignore[no-untyped-def]
    from autoprec.policy import ROOT

    return json.dumps({("(default)" if n == ROOT else n): f.value for n, f in policy.layers.items()}, sort_keys=True)


def part_tables(name: str, out: Path, args: argparse.Namespace, until: float) -> int:
    from autoprec.files import write_text
    from autoprec.tune._measure._choices import build_choices
    from autoprec.tune._measure._timing import interleaved_times
    from autoprec.tune._measure._trainer import Trainer, compile_scope, step_stats
    from autoprec.tune._search._out_dir import load_or_profile

    folder = out / f"tables-{name}"
    folder.mkdir(exist_ok=True)
    workload = workload_of(name, args)
    space, config = search_settings(name, args)
    start = time.time()  # the search's own profile where it ran; else measured, and saved where the search reuses it
    prof = load_or_profile(workload, space, out / f"search-{name}", config)
    print(f"gpu_suite: tables-{name}: profile ready in {time.time() - start:.0f} s", flush=True)
    rows = prof.frame().to_dict("records")  # profile.csv's cells, as the table of layer times has always written them
    with open(folder / "layer_times.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=LAYER_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    choices = build_choices(prof, space, config.budget, workload.device)
    policies = table_policies(choices, 1 if args.smoke else args.policies or POLICIES)
    layer_names = sorted({k for p in policies.values() for k in json.loads(formats_of(p))}, key=lambda k: (k != "(default)", k))
    fields = [*STEP_FIELDS[:3], *layer_names, *STEP_FIELDS[3:]]
    path = folder / "step_times.csv"
    done = kept_rows(folder, prof.device, fields)
    write_text(folder / "device.json", json.dumps({"device": prof.device, "compiled": config.compile, "timing":
               config.timing.__dict__, "choices": json.loads(choices.to_json())}, indent=2, default=str) + "\n")  # fmt: skip
    slowest, skipped = 0.0, []
    for number, (label, policy) in enumerate(policies.items()):
        formats = json.loads(formats_of(policy))
        earlier = done.get(label)
        if earlier is not None and all(earlier[k] == v for k, v in formats.items()):
            continue
        if skipped or left(until) < MARGIN * slowest:
            skipped.append(label)
            continue
        began = time.time()
        row: dict[str, object] = {"trial": number, "policy": label, "state": "COMPLETE", **formats}
        try:
            with compile_scope(config.compile, 2):  # as a trial: a fresh compiled fp32 baseline beside the candidate
                baseline = Trainer(workload, policies["fp32"], compiled=config.compile)  # type: ignore[arg-type]
                candidate = Trainer(workload, policy, compiled=config.compile)  # type: ignore[arg-type]
                baseline.step()
                candidate.step()
                t = interleaved_times({"fp32": baseline, "policy": candidate}, workload.device, config.timing)
                stats = step_stats({"policy": candidate}, t)["policy"]
            row.update(
                step_ms=t["policy"].median_ms, skipped=stats.skipped, steps=stats.steps, effective_step_ms=stats.effective_ms,
                fp32_step_ms=t["fp32"].median_ms, speedup=t["fp32"].median_ms / stats.effective_ms,
                spread=max(t["policy"].spread, t["fp32"].spread), policy_spread=t["policy"].spread,
                fp32_spread=t["fp32"].spread, rounds=len(t["policy"].samples_ms),
                compile_s=(candidate.first_step_s or 0.0) + (baseline.first_step_s or 0.0),
                samples_ms=" ".join(f"{x:.6g}" for x in t["policy"].samples_ms),
                fp32_samples_ms=" ".join(f"{x:.6g}" for x in t["fp32"].samples_ms),
            )  # fmt: skip
        except Exception as exc:  # a format this device cannot step: the row says so, the others go on
            row.update(state="FAIL", error=f"{type(exc).__name__}: {exc}"[:300])
        row["measure_s"] = time.time() - began
        slowest = max(slowest, time.time() - began)
        done[label] = {k: "" if v is None else str(v) for k, v in row.items()}
        with open(path.with_suffix(".tmp"), "w", newline="", encoding="utf-8") as f:  # rewritten whole after each
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(sorted(done.values(), key=lambda r: int(r["trial"])))
        path.with_suffix(".tmp").replace(path)
        print(f"gpu_suite: tables-{name}: {label}: {row.get('speedup', float('nan')):.3f}x fp32 in {row['measure_s']:.0f} s",
              flush=True)  # fmt: skip
    timed = sum(1 for r in done.values() if r["policy"] in policies)
    text = f"{len(rows)} layer x format times, {timed} of {len(policies)} policies timed" + (
        f"; not timed: {len(skipped)} (the deadline): run the same command again for them" if skipped else ""
    )
    note(out, f"tables-{name}", complete=not skipped, text=text)
    return 0


def kept_rows(folder: Path, device: str, fields: list[str]) -> dict[str, dict[str, str]]:
    """An earlier run's step_times.csv rows by policy, to resume: those of the same columns (the same choices), and
    none where they were timed on another device (device.json; a fresh machine of another kind): timed again."""
    path = folder / "step_times.csv"
    if not path.is_file():
        return {}
    try:
        measured_on = str(json.loads((folder / "device.json").read_text(encoding="utf-8"))["device"])
    except (OSError, ValueError, KeyError, TypeError):
        measured_on = None  # no record of where: not reused either
    if measured_on != device:
        print(f"gpu_suite: {folder.name}: step_times.csv was timed on {measured_on or 'an unrecorded device'}, this is "
              f"{device}: timing every policy again", flush=True)  # fmt: skip
        path.replace(folder / f"step_times.{measured_on or 'unknown'}.csv".replace(" ", "_").replace("/", "_"))
        return {}  # moved aside first: a stop before the first new row cannot leave them under this device's name
    with open(path, newline="", encoding="utf-8") as f:
        return {r["policy"]: r for r in csv.DictReader(f) if set(r) == set(fields)}


def summary(out: Path) -> str:
    """One row per searched model: step time of each alternative and of the policy, speedups over uniform bf16 and
    over the fastest uniform alternative measured, the policy's metric drop and the search's wall time."""
    from autoprec.tune._core._memory import human_bytes
    from autoprec.tune._core._tables import markdown_table

    headers = ["model", *(f"{c} ms" for c in COLUMNS), "policy ms", "policy / bf16", "fastest alternative",
               "policy / fastest", "policy drop", "chosen", "search s"]  # fmt: skip
    rows, device = [], "?"
    for path in sorted(out.glob("search-*/result.json")):
        r = json.loads(path.read_text(encoding="utf-8"))
        device = r["device"]
        # a candidate that failed or never ran has no step time (null): NaN, shown as "-"
        ms = {f["candidate"]: float("nan") if f["effective_step_ms"] is None else f["effective_step_ms"] for f in r["finals"]}
        bf16 = ms.get(BF16, float("nan"))
        chosen = next(f for f in r["finals"] if f["candidate"] == r["chosen"])
        timed = {c: ms[c] for c in COLUMNS if c in ms and ms[c] == ms[c]}  # NaN: not measured
        fastest = min(timed, key=timed.__getitem__) if timed else "-"
        rows.append([r["model"], *(ms.get(c, float("nan")) for c in COLUMNS), ms[r["chosen"]], bf16 / ms[r["chosen"]], fastest,
                     timed.get(fastest, float("nan")) / ms[r["chosen"]], chosen["metric_drop"], r["chosen"],
                     round(r["wall_s"])])  # fmt: skip
    memory_rows = []
    for path in sorted(out.glob("search-*/result.json")):
        r = json.loads(path.read_text(encoding="utf-8"))
        peak = {f["candidate"]: f.get("peak_bytes") for f in r["finals"]}  # absent in results from before memory
        memory_rows.append([r["model"], *(human_bytes(peak.get(c)) for c in (FP32, BF16, FP8_EVERYWHERE, FP8_ROWWISE_EVERYWHERE,
                                                                               r["chosen"]))])  # fmt: skip
    text = (
        f"# autoprec GPU suite: {device}\n\n`python benchmarks/gpu_suite.py --out {out}`\n\n"
        + markdown_table(headers, rows)
        + "\n\nPeak memory per training step (the model and optimizer state plus the step's peak above it; "
        "autoprec.tune._core._memory: the CUDA allocator's peak on a GPU, '-' where not measured):\n\n"
        + markdown_table(["model", "fp32", "uniform bf16", "fp8 everywhere", "fp8 rowwise everywhere", "policy"], memory_rows)
        + f"\n\nStep times are effective training-step milliseconds (compiled, re-measured together, interleaved); "
        f"policy / bf16 and policy / fastest are the policy's speedups over uniform bf16 autocast and over the fastest "
        f"alternative measured (above 1: faster); a missing alternative (nan) was not measured here (TF32 needs CUDA; "
        f"fp8 everywhere needs fp8 kernels, that recipe's format in the space and a layer torchao's filter converts) or "
        f"failed (search-<model>/finalists.csv says why). "
        f"Budget {BUDGET} on -(mean eval loss). Per model: search-<model>/summary.md.\n"
    )
    (out / "summary.md").write_text(text, encoding="utf-8")
    return text


def tables_summary(out: Path) -> str:
    """One line per model's tables: how many layer times and timed policies, and the range of their speedups."""
    lines = []
    for folder in sorted(out.glob("tables-*")):
        path = folder / "step_times.csv"
        if not path.is_file():
            continue
        with open(path, newline="", encoding="utf-8") as f:
            rows = [r for r in csv.DictReader(f) if r["state"] == "COMPLETE"]
        with open(folder / "layer_times.csv", newline="", encoding="utf-8") as f:
            layers = sum(1 for _ in csv.DictReader(f))
        speedups = sorted(float(r["speedup"]) for r in rows)
        spreads = sorted(float(r["spread"]) for r in rows)
        span = (
            f"speedups {speedups[0]:.3f}x to {speedups[-1]:.3f}x, median spread ±{50 * spreads[len(spreads) // 2]:.0f}%"
            if rows
            else ""
        )
        lines.append(f"- {folder.name}: {layers} layer x format times, {len(rows)} whole-step policy timings; {span}")
    return (
        ("\n\nTiming tables for a replay (tables-<model>/layer_times.csv, step_times.csv):\n\n" + "\n".join(lines) + "\n")
        if lines
        else ""
    )


def run_part(part: str, out: Path, args: argparse.Namespace, until: float) -> int:
    """One part in this process (the child), planning with the time left before `until` (its share of the command's
    time: the parts after it get theirs); a test chunk or benchmark is stopped only at args._until (the deadline)."""
    if part == "tests":
        return part_tests(out, args, until)
    if part == "bench":
        return part_bench(out, args, until)
    if part.startswith("tables-"):
        return part_tables(part.removeprefix("tables-"), out, args, until)
    return part_search(part, out, args, until)


def finished(out: Path, part: str) -> bool:
    """Whether an earlier run of this command finished the part (its status says complete)."""
    path = out / "status" / f"{part}.json"
    try:
        return bool(json.loads(path.read_text(encoding="utf-8")).get("complete"))
    except (OSError, ValueError):
        return False


def child(part: str, out: Path, args: argparse.Namespace, aim: float, until: float) -> tuple[str, int | None]:
    """Run the part in a child process that plans to end by `aim`, its output echoed and kept in logs/<part>.txt,
    stopped at `until` (the deadline): (what became of it, its exit code or None when stopped)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--part", part, "--device", args.device,
           "--gpu", args.gpu, "--_aim", repr(aim), "--_until", repr(until)]  # fmt: skip
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--trials", str(args.trials)] if args.trials else []
    cmd += ["--policies", str(args.policies)] if args.policies else []
    (out / "logs").mkdir(exist_ok=True)
    log = open(out / "logs" / f"{part}.txt", "a", encoding="utf-8")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, process_group=0)

    def echo() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    try:
        rc: int | None = proc.wait(timeout=wait_s(until, 5))  # the child stops itself first, where it can
    except subprocess.TimeoutExpired:
        rc = None
        os.killpg(proc.pid, signal.SIGTERM)  # its own group (not session: the device ends it with the call): pytest too
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=5)
    log.close()
    if rc is None:
        return "stopped at the deadline: run the same command again to resume it", None
    if finished(out, part):
        return "complete", rc
    return ("partial: run the same command again to resume it" if rc == 0 else f"failed (exit code {rc})"), rc


def pack(out: Path, folder: Path) -> list[Path]:
    """suite.tar.gz (all of --out), summary.md and status.json in `folder`: what the device call brings back."""
    folder.mkdir(parents=True, exist_ok=True)
    tar_path = folder / "suite.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=lambda info: None if ".autoprec.claim" in info.name else info)
    files = [tar_path]
    for name in ("summary.md", "status.json"):
        if (out / name).is_file():
            shutil.copyfile(out / name, folder / name)
            files.append(folder / name)
    if tar_path.stat().st_size > PACK_WARN:
        print(f"gpu_suite: {tar_path} is {tar_path.stat().st_size / 2**20:.1f} MiB: the device returns files up to 16 MiB",
              file=sys.stderr)  # fmt: skip
    return files


def gpu_problem(args: argparse.Namespace) -> str | None:
    """Why this command should not run here: --smoke without --out, or a GPU other than the one --gpu names."""
    if args.smoke:
        return None if args.out else "--smoke needs --out DIR (a smoke run's numbers mean nothing in results/)"
    name = torch.cuda.get_device_name(torch.device(args.device)) if torch.device(args.device).type == "cuda" else args.device
    if GPUS[args.gpu] not in name:
        other = next((g for g, tag in GPUS.items() if tag in name), None)
        hint = f"run with --gpu {other} (results/{other})" if other else f"this suite knows {', '.join(sorted(GPUS))}"
        return f"--gpu {args.gpu}: this machine's device is {name}, not an {GPUS[args.gpu]}; {hint}"
    return None


def main() -> int:
    began = time.time()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100",
                        help="the GPU this command expects (default h100; h200 where only that is lent): refused on "
                        "another, so no folder mixes two devices' numbers")  # fmt: skip
    parser.add_argument("--out", help="output folder (default results/<gpu>; required with --smoke)")
    parser.add_argument("--part", default="all", help=f"parts, comma-separated: {', '.join(PARTS)}, summary or all (default)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: the whole path on a CPU in minutes")
    parser.add_argument("--trials", type=int, help="trials per search (default: tinylm 24, gpt2 16; smoke 2)")
    parser.add_argument("--policies", type=int, help=f"random policies per model in the tables (default {POLICIES}; smoke 1)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help=f"seconds the whole command may take, packing aside (default {DEADLINE_S:.0f}; --smoke: none, "
                        "its work is bounded by its sizes, so a loaded machine finishes it later, never less of it)")  # fmt: skip
    parser.add_argument("--pack", type=Path, help="folder ($OUT on the device) for suite.tar.gz, summary.md and status.json")
    parser.add_argument("--_aim", type=float, help=argparse.SUPPRESS)  # a child: run the one part, planned to end then
    parser.add_argument("--_until", type=float, help=argparse.SUPPRESS)  # and stopped then
    args = parser.parse_args()
    args.device = args.device or str(default_device())
    if not args.smoke and args.device == "cpu":
        print("gpu_suite: the full suite is for a GPU; on a CPU run it with --smoke", file=sys.stderr)
        return 2
    names = [p.strip() for p in args.part.split(",") if p.strip()]
    unknown = [p for p in names if p not in (*PARTS, "summary", "all")]
    if unknown or not names:
        print(f"gpu_suite: --part {args.part}: unknown {', '.join(unknown) or 'nothing'}; choose from "
              f"{', '.join(PARTS)}, summary, all (comma-separated)", file=sys.stderr)  # fmt: skip
        return 2
    if args.deadline_s is not None and not args.deadline_s > 0:
        print(f"gpu_suite: --deadline-s {args.deadline_s}: give a number of seconds > 0, e.g. 480", file=sys.stderr)
        return 2
    problem = gpu_problem(args)
    if problem:
        print(f"gpu_suite: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out or ROOT / "results" / args.gpu)
    out.mkdir(parents=True, exist_ok=True)
    if args._aim is not None:
        return run_part(names[0], out, args, args._aim)
    parts = [p for p in (PARTS if "all" in names else names) if p != "summary"]
    if args.smoke:
        parts = [p for p in parts if p not in SMOKE_LEFT_OUT]
    deadline = args.deadline_s if args.deadline_s is not None else (math.inf if args.smoke else DEADLINE_S)
    until = began + deadline
    try:  # an earlier run's, kept for the parts this one does not run
        status = json.loads((out / "status.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        status = {}
    try:
        run_parts(parts, out, args, until, status)
    finally:  # whatever happened, what there is comes back
        text = summary(out) + tables_summary(out)
        (out / "summary.md").write_text(text, encoding="utf-8")
        print(text)
        print(
            "gpu_suite: parts: "
            + "; ".join(f"{p} {status[p]['state']} ({status[p]['wall_s']:.0f} s)" for p in parts if p in status)
        )
        if args.pack is not None:
            files = pack(out, args.pack)
            print(f"gpu_suite: packed {', '.join(str(f) for f in files)} after {time.time() - began:.0f} s", flush=True)
    return 1 if any(s.get("rc") not in (0, None) for p, s in status.items() if p in parts) else 0


def run_parts(parts: list[str], out: Path, args: argparse.Namespace, until: float, status: dict) -> None:
    """Each part in a child process, each given its share of the time left (SHARE), all stopped at `until`; what
    became of each in `status` and status.json."""
    for part in parts:
        start = time.time()
        if finished(out, part):
            state, rc = "complete (in an earlier run; not run again)", 0
        elif left(until) < 15:
            state, rc = "not started: no time left before the deadline; run it in the next call", None
        else:
            todo = sum(SHARE.get(p, 1.0) for p in parts[parts.index(part) :] if not finished(out, p))
            state, rc = child(part, out, args, time.time() + left(until) * SHARE.get(part, 1.0) / todo, until)
        wall = time.time() - start
        text = (
            (out / "status" / f"{part}.json").read_text(encoding="utf-8") if (out / "status" / f"{part}.json").is_file() else "{}"
        )
        status[part] = {"state": state, "wall_s": round(wall, 1), "note": json.loads(text).get("note", ""),
                        "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"), "rc": rc}  # fmt: skip
        (out / "status.json").write_text(json.dumps(status, indent=2) + "\n", encoding="utf-8")
        print(f"gpu_suite: part {part}: {state} ({wall:.0f} s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
