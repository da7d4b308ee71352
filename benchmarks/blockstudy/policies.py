"""Phases 2 and 3: the policies that the train-mode searches with the FLOP goal (`--part search`) and the loss curves
over 10x the search's train steps (`--part horizon2`, `--part horizon`) compare: the anchors and the hand rules, the
searched policies' labels, each policy's FLOP-weighted GEMM shares, and the example as an autoprec workload.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from torch import nn

from .common import layer_role, load_example

BF16_KEPT_SHARE = 0.15  # rule (a): torchtitan's "last ~15% of blocks" kept in high precision
# The --tag fallback searches ran after autoprec let a FLOP goal's lists keep bf16 instead of fp32 (Goal.fallbacks) and
# priced the greedy start by the goal (the target's GEMM time): no list holds fp32 (which the estimate prices at 30x
# bf16's time), the root is bf16 already (bf16_root leaves it so), the low formats are the postfix searches'.
FALLBACK_TAGS = ("fallback",)
TAG_TEXT = {
    "": "before e97993f (HP GEMMs priced at fp32)",
    "postfix": "after e97993f (HP GEMMs in the autocast)",
    "fallback": "bf16 fallback, goal-priced greedy start (no fp32 in the space)",
}
HIGH = ("fp32", "tf32", "bf16", "fp16")  # GEMM element formats that are not low precision


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def last_blocks(n_blocks: int, share: float = BF16_KEPT_SHARE) -> list[int]:
    """The last `share` of the blocks: max(1, round(share * n)) of them (12 blocks: round(1.8) = 2, blocks 10-11)."""
    k = max(1, round(share * n_blocks))
    return list(range(n_blocks - k, n_blocks))


def rule_layers(names: list[str], n_blocks: int) -> dict[str, dict[str, str]]:
    """Each hand rule as {Linear name: low format} (every Linear not listed stays in the bf16 root):
    (a) the last 15% of blocks and the head in bf16, the rest NVFP4; (b) the first and the last block in bf16, the rest
    NVFP4 (the head too: the rule names blocks only); (c) everything NVFP4 but the head; (d) the MLP's Linears NVFP4,
    attention's MXFP8, the head bf16."""
    kept_a = set(last_blocks(n_blocks))
    rules: dict[str, dict[str, str]] = {"rule-a": {}, "rule-b": {}, "rule-c": {}, "rule-d": {}}
    for name in names:
        block, role = layer_role(name)
        if block < 0:  # the head
            rules["rule-b"][name] = "nvfp4"
            continue
        if block not in kept_a:
            rules["rule-a"][name] = "nvfp4"
        if block not in (0, n_blocks - 1):
            rules["rule-b"][name] = "nvfp4"
        rules["rule-c"][name] = "nvfp4"
        rules["rule-d"][name] = "mxfp8" if role.startswith("attn.") else "nvfp4"
    return rules


RULE_TEXT = {
    "bf16": "every Linear bf16 (the baseline)",
    "nvfp4-all": "every Linear NVFP4 (where the format takes its shape), the rest bf16",
    "rule-a": "last 15% of blocks and the head bf16, rest NVFP4",
    "rule-b": "first and last block bf16, rest NVFP4 (head included)",
    "rule-c": "everything NVFP4 but the head",
    "rule-d": "MLP NVFP4, attention MXFP8, head bf16",
}


def study_policies(model: nn.Module, device="cpu") -> dict[str, object]:
    """The anchors (uniform bf16, NVFP4 on every Linear that takes it) and the rules (a)-(d), as autoprec Policies
    with a bf16 root; a Linear whose shape a format refuses (format_problem) stays bf16."""
    from autoprec.formats import Format, format_problem, parse_format
    from autoprec.policy import Policy

    modules = dict(model.named_modules())
    names = linear_names(model)
    sets = {"bf16": {}, "nvfp4-all": dict.fromkeys(names, "nvfp4"), **rule_layers(names, len(model.h))}
    out = {}
    for label, layers in sets.items():
        ok = {n: parse_format(f) for n, f in layers.items() if format_problem(parse_format(f), modules[n], device) is None}
        out[label] = Policy(layers={"": Format.BF16, **ok})
    return out


def flops_table(model: nn.Module, tokens: int):
    """Profile rows with what gemm_flops reads (layer, type, shape "out x in", tokens) for every Linear of `model`,
    each called on `tokens` rows a training step (an fp32 row each: nothing else is measured)."""
    from autoprec.tune._core._profile_row import ProfileRow

    return [
        ProfileRow(
            layer=n,
            type=type(m).__name__,
            shape=f"{m.out_features}x{m.in_features}",
            tokens=float(tokens),
            format="fp32",
            status="ok",
        )
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]


def gemm_share(policy, flops: dict[str, float]) -> dict[str, float]:
    """The FLOP-weighted share of the Linears' GEMMs (three per Linear, each 2 x tokens x in x out) in each element
    format under `policy`, and `low` the share in a format below bf16 (fp8, mxfp8, nvfp4)."""
    from autoprec.tune._decide._flops import format_of, gemm_precisions, outer_autocast

    by: dict[str, float] = defaultdict(float)
    for name, work in flops.items():
        # a per-GEMM mix's high-precision GEMMs run in the autocast around the layer (bf16 under a bf16 root)
        for precision in gemm_precisions(format_of(name, policy.layers), outer_autocast(name, policy.layers)):
            by[precision] += work
    total = sum(by.values())
    share = {p: v / total for p, v in by.items()}
    share["low"] = sum(v for p, v in share.items() if p not in HIGH)
    return share


def gpt2_workload(size: str):
    """The example's trained model as an autoprec Workload on the CPU (its train and eval batches, its loss)."""
    from autoprec.tune import prepare
    from autoprec.tune._api import task_from_objects

    example = load_example(size)
    model = example.build_model()
    task = task_from_objects(model, example.loss_fn, example.batches("train"), example.batches("eval"), name=f"gpt2-{size}")
    return example, prepare(task, "cpu")


def searched_label(folder: Path) -> str:
    """search/budget-0.04-grouped -> searched-0.04-grouped."""
    return "searched-" + folder.name.split("-", 1)[1]


def label_tag(label: str) -> str:
    """searched-0.04-grouped-postfix -> postfix; searched-0.04-grouped, searched-0.04 -> ''."""
    parts = label.split("-")
    return parts[3] if len(parts) > 3 else ""


def searched_text(label: str) -> str:
    layout = label.split("-")[2] if label.count("-") > 1 else "ranked"
    root = "root bf16 as searched" if label_tag(label) in FALLBACK_TAGS else "root set to bf16"
    return (
        f"searched ({layout}), budget {label_budget(label):g} at K steps vs fp32; {root}; "
        f"{TAG_TEXT.get(label_tag(label), label_tag(label))}"
    )


def label_budget(label: str) -> float:
    """searched-0.04-grouped -> 0.04."""
    return float(label.split("-")[1])


def all_policies(model: nn.Module, out: Path) -> dict[str, object]:
    """The anchors and rules, then each searched policy found under out/search/ (by budget)."""
    from autoprec.policy import load_policy

    found = study_policies(model)
    folders = sorted((out / "search").glob("budget-*"), key=lambda p: (p.name.count("-"), float(p.name.split("-")[1])))
    for folder in folders:
        if (folder / "policy.json").exists():
            found[searched_label(folder)] = bf16_root(load_policy(folder / "policy.json"))
    return found


def bf16_root(policy):
    """The policy with its model root in bf16 and every Linear as the search chose it. The untagged and postfix
    searches' root list had to hold fp32 (then autoprec's fallback), and the FLOP goal counts Linears only, so the root
    a FLOP search settles on is whatever the sampler drew; every policy of this study runs its norms, softmax and
    attention matmuls in bf16, so the searched ones do too (their Linears, all the goal counts, unchanged). The
    fallback searches' root is bf16 already (their root list holds only bf16): for them this changes nothing."""
    from autoprec.formats import Format
    from autoprec.policy import ROOT, Policy

    return Policy(layers={**policy.layers, ROOT: Format.BF16}, loss_scale=policy.loss_scale)
