"""One search worker for tests/test_workers.py: `autoprec search` on tests/models/overflow_mlp.py with the
measurements cut short, run as its own process (`python tests/search_worker.py --out DIR ...`).

The CLI has no timing flags, so this builds the SearchConfig itself. `--sleep S` holds every trial S seconds
after it picks its params and before it measures, so a test can find a trial RUNNING and kill its worker. The last line printed is JSON:
the study's name, its storage and the choices this worker searched.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch
from short_timing import FAST_PROFILE, TINY
from timings import MODES, FormatClock

from autoprec.tune import SearchConfig, load_task, prepare
from autoprec.tune._core._space import space_from_dict
from autoprec.tune._measure import _timing as timing
from autoprec.tune._search._pipeline import search

MODEL = Path(__file__).parent / "models" / "overflow_mlp.py"
SPACE = {"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16"]}, "prune": {"slower_than": 100}}
HOLDING = "test:holding"  # user attr of a trial held by --sleep, its params chosen


def _slow_trials(seconds: float) -> None:
    study_module = importlib.import_module("autoprec.tune._search._objective")
    real = study_module.suggest

    def suggest(trial, choices, space):
        policy = real(trial, choices, space)
        trial.set_user_attr(HOLDING, True)  # its params are stored: a test may kill this worker now
        time.sleep(seconds)
        return policy

    study_module.suggest = suggest


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--storage")
    parser.add_argument("--study", default="workers")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--heartbeat", type=int, default=1)
    parser.add_argument("--timings", choices=sorted(MODES), default="faster")  # as the suite's: no step time is the machine's
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    timing.CLOCK = FormatClock(MODES[args.timings])  # this process is the test's, not a library's
    if args.sleep:
        _slow_trials(args.sleep)
    config = SearchConfig(
        budget=0.5, trials=args.trials, storage=args.storage, study_name=args.study, heartbeat_s=args.heartbeat,
        timing=TINY, final_timing=TINY, finalists=1, progress=False, profile=FAST_PROFILE,
    )  # fmt: skip
    workload = prepare(load_task(MODEL), torch.device("cpu"))
    result = search(workload, space_from_dict(SPACE), config, args.out)
    print(json.dumps({"study": result.study_name, "storage": result.storage, "choices": result.choices.to_json()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
