"""Search cost against answer quality on the bundled examples: each searched as a user would (`autoprec search`
at its README budget), timed end to end, with its "where the time went" table; then the chosen policy re-measured
beside fp32 and uniform bf16 and, with --against, beside the policy an earlier search (another version of
autoprec, another setting) chose for the same model, all in one interleaved run, so the answers compare fairly.

    python benchmarks/search_cost.py --out results/<device>/search-cost [--models digits,minilm] [--against DIR]

DIR holds <model>/policy.json, as this script's --out does. Writes <out>/<model>/ (the search's files and
result.json) and <out>/summary.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_device_flag, parse_device, print_header  # noqa: E402

from autoprec import Policy, load_policy  # noqa: E402
from autoprec.tune import SearchConfig, load_space, load_task, prepare  # noqa: E402
from autoprec.tune._api import search_and_report  # noqa: E402
from autoprec.tune._core._budget import Budgets  # noqa: E402
from autoprec.tune._core._names import BF16, FP32  # noqa: E402
from autoprec.tune._core._records import Candidate, Measured  # noqa: E402
from autoprec.tune._core._tables import markdown_table  # noqa: E402
from autoprec.tune._report._results import cost_rows  # noqa: E402
from autoprec.tune._search._finalists import remeasure  # noqa: E402
from autoprec.tune._search._objective import Judge  # noqa: E402

# model -> (model.py, budget, trials): the README's commands
MODELS = {
    "digits": (ROOT / "examples" / "digits" / "model.py", 0.01, None),
    "minilm": (ROOT / "examples" / "minilm" / "model.py", 0.01, 16),
}


def search_one(name: str, device, out: Path) -> dict:
    path, budget, trials = MODELS[name]
    workload = prepare(load_task(path), device)
    config = SearchConfig(budget=budget, trials=trials, progress=False)
    command = f"autoprec search {path.relative_to(ROOT)} --budget {budget:g}" + (f" --trials {trials}" if trials else "")
    start = time.perf_counter()
    result = search_and_report(workload, load_space(), config, out / name, command=command)
    wall = time.perf_counter() - start
    m = Measured.of(result.policy)
    print(f"{name}: chose {m.chosen} in {wall:.0f} s", file=sys.stderr)
    return {"model": name, "wall_s": wall, "chosen": m.chosen, "cost": result.cost, "budget": budget,
            "speedup": m.results["policy"].speedup, "metric_drop": m.results["policy"].metric_drop}  # fmt: skip


def compare(name: str, device, out: Path, against: Path | None) -> list[list[object]]:
    """This search's policy beside fp32, uniform bf16 and the earlier one, re-measured together."""
    path, budget, _ = MODELS[name]
    workload = prepare(load_task(path), device)
    candidates = {FP32: Candidate(Policy()), BF16: Candidate(Policy(layers={"": "bf16"})),
                  "this search": Candidate(_bare(load_policy(out / name / "policy.json")))}  # fmt: skip
    earlier = against / name / "policy.json" if against else None
    if earlier is not None and earlier.is_file():
        candidates["earlier search"] = Candidate(_bare(load_policy(earlier)))
    config = SearchConfig(budget=budget, progress=False)
    fp32_metric = Measured.of(load_policy(out / name / "policy.json")).fp32_metric
    if fp32_metric is None:
        raise SystemExit(f"{out / name / 'policy.json'}: no measured.fp32_metric to compare the drops against")
    judge = Judge(workload, config, fp32_metric, budgets=Budgets((budget,)))
    finals = remeasure(workload, candidates, judge, budget, config.final_timing, progress=f"re-measuring {name}")
    return [
        [name, r.candidate, r.metric_drop, r.speedup, f"±{50 * r.spread:.1f}%", "yes" if r.feasible else "no"] for r in finals
    ]


def _bare(policy: Policy) -> Policy:
    return Policy(layers=policy.layers, loss_scale=policy.loss_scale)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder, e.g. results/<device>/search-cost")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--against", type=Path, default=None, help="an earlier --out: re-measure its policies beside")
    add_device_flag(parser)
    args = parser.parse_args()
    device = parse_device(args.device)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; valid: {', '.join(MODELS)}")
    print_header("search cost against answer quality", device)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, costs, compared = [], [], []
    for name in names:
        r = search_one(name, device, args.out)
        (args.out / name / "result.json").write_text(json.dumps(r, indent=2) + "\n", encoding="utf-8")
        rows.append([name, r["budget"], round(r["wall_s"]), r["chosen"], r["speedup"], r["metric_drop"]])
        costs.append(
            f"### {name}\n\n" + markdown_table(["where the time went", "seconds", "share", "count"], cost_rows(r["cost"]))
        )
        compared += compare(name, device, args.out, args.against)
    against = f" --against {args.against}" if args.against else ""
    text = (
        f"# Search cost against answer quality\n\n`python benchmarks/search_cost.py --out {args.out} --models "
        f"{','.join(names)}{against}`\n\n"
        + markdown_table(["model", "budget", "search s", "chosen", "speedup (search's re-measure)", "drop"], rows)
        + "\n\n## The answers re-measured together (one interleaved run per model)\n\n"
        + markdown_table(["model", "policy", "metric drop", "speedup over fp32", "spread", "within budget"], compared)
        + "\n\n## Where the time went\n\n"
        + "\n\n".join(costs)
        + "\n"
    )
    (args.out / "summary.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
