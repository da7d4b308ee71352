"""A step's shapes for the predictor (autoprec/tune/_measure/_step_shapes.py): the step traced on the meta device
(Linear subclasses by type, fused attention as one op, a shared input read once) and a profile's rows (a Linear by
its flag, else by its type's name)."""

from __future__ import annotations

import pytest
import torch
from builders import small_task
from short_timing import FAST_PROFILE

from autoprec.tune._core._profile_row import ProfileRow
from autoprec.tune._decide._flops import gemm_flops
from autoprec.tune._measure._profile_data import Profile
from autoprec.tune._measure._step_shapes import step_from_rows, trace_step


class Proj(torch.nn.Linear):
    """A Linear subclass whose name does not end in Linear: a Linear all the same."""


class Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = Proj(64, 64), Proj(64, 64), Proj(64, 64), Proj(64, 64)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (m(x).view(b, t, 4, 16).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(torch.relu(y.transpose(1, 2).reshape(b, t, d)))


def test_the_traced_step_counts_linear_subclasses_and_fused_attention_on_the_meta_device():
    with torch.device("meta"):
        model = Attn()
        x = torch.empty(2, 32, 64)
    step = trace_step(model, lambda: model(x).sum())
    assert [(s.name, s.tokens, s.reads) for s in step.linears] == [
        ("q", 64.0, None), ("k", 64.0, "q"), ("v", 64.0, "q"), ("o", 64.0, None)
    ]  # fmt: skip
    # attention: QK^T and PV (2 x 2 x b x h x t x t x d), causal half, backward 2.5x the forward
    assert step.other_flops == pytest.approx(4 * 2 * 4 * 32 * 32 * 16 / 2 * 3.5)
    assert step.params == 4 * (64 * 64 + 64) and step.other_bytes > 0 and "q" in step.modules


def test_a_profile_counts_a_linear_subclass_by_type_and_an_older_profile_still_reads(tmp_path, write_model):
    from autoprec.tune import load_task, prepare, profile
    from autoprec.tune._core._space import space_from_dict

    path = write_model(
        small_task(
            "class Proj(nn.Linear):\n    pass\n\n"
            "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.inp = Proj(8, 16)\n        self.out = nn.Linear(16, 4)\n\n"
            "    def forward(self, x):\n        return self.out(torch.relu(self.inp(x)))\n\n"
            "def build_model():\n    torch.manual_seed(0)\n    return Net()\n"
        )
    )
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16"]}})
    prof = profile(prepare(load_task(path), "cpu"), space, FAST_PROFILE, progress=False)
    assert {r.layer: (r.type, r.linear) for r in prof.rows} == {"inp": ("Proj", True), "out": ("Linear", True)}
    assert gemm_flops(prof.rows) == {"inp": 2 * 4 * 8 * 16, "out": 2 * 4 * 16 * 4}  # Proj was 0 FLOPs before
    prof.save(tmp_path / "new")
    assert [(r.layer, r.linear) for r in Profile.load(tmp_path / "new").rows] == [(r.layer, r.linear) for r in prof.rows]
    # a profile written before the column: it reads, and a type named ...Linear counts as before
    prof.save(tmp_path / "old")
    table = (tmp_path / "old" / "profile.csv").read_text().splitlines()
    drop = table[0].split(",").index("linear")
    (tmp_path / "old" / "profile.csv").write_text(
        "\n".join(",".join(c for i, c in enumerate(line.split(",")) if i != drop) for line in table) + "\n"
    )
    old = Profile.load(tmp_path / "old")
    assert {r.linear for r in old.rows} == {None} and gemm_flops(old.rows) == {"out": 2 * 4 * 16 * 4}


def test_rows_from_a_hand_made_profile_count_by_the_flag_else_by_name():
    rows = [
        ProfileRow(layer="a", type="Proj", shape="16x8", tokens=4.0, format="fp32", status="ok", linear=True),
        ProfileRow(layer="b", type="Conv", shape="16x8", tokens=4.0, format="fp32", status="ok", linear=False),
        ProfileRow(layer="c", type="MyLinear", shape="16x8", tokens=4.0, format="fp32", status="ok"),
    ]
    assert [s.name for s in step_from_rows(rows).linears] == ["a", "c"]
