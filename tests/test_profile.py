import math
from pathlib import Path

import pytest
import torch

from autoprec import ProfileConfig, load_task, prepare, profile
from autoprec.measure import TimingConfig
from autoprec.profile import COLUMNS, Profile
from autoprec.space import space_from_dict

MODELS = Path(__file__).parent / "models"
FAST = ProfileConfig(batches=2, timing=TimingConfig(warmup=1, rounds=2, min_block_s=0.0))


@pytest.fixture(scope="module")
def prof():
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"layers": {"Linear": ["fp32", "bf16", "fp16", "fp8"]}})
    return profile(workload, space, FAST, progress=False)


def row(prof, layer, fmt):
    t = prof.table
    return t[(t["layer"] == layer) & (t["format"] == fmt)].iloc[0]


def test_one_row_per_layer_and_format(prof):
    assert list(prof.table.columns) == COLUMNS
    assert prof.layers() == ["fc1", "big", "head"]
    assert len(prof.table) == 12


def test_fp16_overflow_is_found(prof):
    r = row(prof, "big", "fp16")
    assert bool(r["overflow"]) and not bool(r["finite"]) and r["max_abs"] > 65504
    assert not bool(row(prof, "big", "bf16")["overflow"])  # bf16 has fp32's range


def test_sqnr_reflects_each_formats_mantissa(prof):
    bf16, fp16, fp8 = (row(prof, "fc1", f)["sqnr_db"] for f in ("bf16", "fp16", "fp8"))
    assert 35 < bf16 < 60 and 55 < fp16 < 80 and 20 <= fp8 < 40  # 8, 11 and 4 mantissa bits
    assert row(prof, "fc1", "fp8")["grad_sqnr_db"] >= 13
    assert row(prof, "fc1", "fp32")["sqnr_db"] == math.inf and row(prof, "fc1", "fp32")["metric_drop"] == 0


def test_unsupported_formats_carry_a_reason(prof):
    r = row(prof, "head", "fp8")
    assert r["status"] == "unsupported" and "divisible by 16" in r["reason"] and math.isnan(r["time_ms"])


def test_every_runnable_format_is_timed(prof):
    ok = prof.table[prof.table["status"] == "ok"]
    assert (ok["time_ms"] > 0).all()
    assert (prof.table[prof.table["format"] == "fp32"]["time_vs_fp32"] == 1.0).all()


def test_save_and_load_round_trip(prof, tmp_path):
    prof.save(tmp_path)
    back = Profile.load(tmp_path)
    assert back.fp32_metric == prof.fp32_metric and back.fingerprint == prof.fingerprint
    assert back.table[["layer", "format", "status"]].equals(prof.table[["layer", "format", "status"]])


def test_a_module_autocast_does_not_lower_is_reported(tmp_path):
    # nn.Bilinear is not on CPU autocast's lower-precision list: it must stay fp32 with the reason.
    src = (MODELS / "overflow_mlp.py").read_text().replace("nn.Linear(64, 64)", "nn.Bilinear(64, 64, 64)")
    src = src.replace("h = self.big(h) / 1e5", "h = self.big(h, h) / 1e5")
    (tmp_path / "bilinear.py").write_text(src)
    workload = prepare(load_task(tmp_path / "bilinear.py"), "cpu")
    space = space_from_dict({"layers": {"Bilinear": ["fp32", "bf16"]}})
    r = profile(workload, space, FAST, progress=False).table.iloc[1]
    assert r["status"] == "unsupported" and "does not lower Bilinear" in r["reason"]
