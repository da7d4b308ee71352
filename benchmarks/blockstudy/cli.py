"""The block study's command line: `--part` names the part (its module in this package), the other options are read by
the parts their help names.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import torch

from . import __doc__ as STUDY
from .common import DEFAULT_OUT, PARTS, _rel


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=STUDY.splitlines()[0])
    parser.add_argument("--part", required=True, choices=sorted(PARTS), help="which figure to make")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {_rel(DEFAULT_OUT)})")
    parser.add_argument("--size", default="mini", help="AUTOPREC_GPT2_SIZE of the GPT-2 example (default: mini)")
    parser.add_argument("--batches", type=int, default=4, help="train batches run through the model (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="seeds stochastic rounding (default: 0)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared 2-core machine two threads ran a mini training step 4x slower)",
    )
    parser.add_argument("--steps", type=int, default=5, help="search, horizon, schedule: K, train mode's steps (default: 5)")
    parser.add_argument(
        "--budgets",
        type=lambda v: [float(b) for b in v.split(",")],
        default=[0.015, 0.04],
        help="search: the budgets, comma-separated, metric units (default: 0.015,0.04: 2x and 5x the "
        "noise floor of 0.0075 measured at K = 5); each budget is its own search, a rerun of some keeps the others' rows",
    )
    parser.add_argument("--trials", type=int, default=60, help="search: trials per budget (default: 60; a trial costs ~3 s)")
    parser.add_argument("--layout", default="ranked", help="search: the space's layout (default: ranked)")
    parser.add_argument(
        "--tag",
        default="",
        help="search: a suffix for the folders and labels (search/budget-<b>-<layout>-<tag>/); a tag's space has the "
        "per-GEMM formats (postfix: searched after autoprec's e97993f; fallback: bf16 in place of fp32, root bf16, after "
        "the FLOP goal took bf16 as its fallback; untagged: the first searches, without them)",
    )
    parser.add_argument("--noise-runs", type=int, default=2, help="search: train mode's fp32 seeds (default: 2)")
    parser.add_argument("--search-seconds", type=float, default=480, help="search: time_budget per budget (default 480)")
    parser.add_argument("--horizon", type=int, default=10, help="horizon, schedule: the long run in multiples of K (default 10)")
    parser.add_argument("--seeds", type=int, default=2, help="horizon, schedule: seeds per policy (default: 2)")
    parser.add_argument(
        "--only",
        type=lambda v: v.split(","),
        default=None,
        help="horizon: run only these policies (and bf16) now; the table covers every finished run",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="horizon2, schedule: take the metric every this many steps, besides 0, K and the last (default: K)",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="horizon2, schedule: run nothing, write the table from the finished runs"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    importlib.import_module(f"{__package__}.{args.part}").run(args)
