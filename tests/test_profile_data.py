import math

import pytest
import torch

from autoprec.tune._core._profile_row import COLUMNS, ProfileRow
from autoprec.tune._measure._gradients import LayerGradients, scale_table
from autoprec.tune._measure._profile_data import Profile, ruled_out


def _row(**fields) -> ProfileRow:
    return ProfileRow(**{"layer": "fc", "type": "Linear", "shape": "16x16", "status": "ok", **fields})


def test_a_slowdown_measured_inside_wide_noise_rules_nothing_out():
    """On a loaded machine a layer's format timed at 2x fp32 with rounds spread ±75% may be as fast as fp32: it stays
    in play (the search times whole steps); measured quietly, or probed many times slower, it is ruled out."""
    row = {"status": "ok", "format": "bf16", "time_vs_fp32": 2.0}
    assert ruled_out(_row(**row, time_spread=1.5), None, 1.25) is None
    assert ruled_out(_row(**row, time_spread=0.1), None, 1.25) == "measured 2.00x the layer's fp32 time on this device"
    assert ruled_out(_row(**row, time_spread=math.nan), None, 1.25) is not None  # probed only: the gap dwarfs the noise


def test_a_gemm_below_its_familys_floor_rules_the_format_out_and_the_message_names_the_floor():
    """The floor is the family's for the format: mxfp8's 20 dB, nvfp4's 10 dB, fp8's 20 dB (its message as before);
    autocast's formats are not judged by it (fp16's gradients are measured without a loss scale)."""
    row = {"status": "ok", "time_vs_fp32": math.nan, "sqnr_db": 28.0, "dgrad_sqnr_db": 28.0, "grad_sqnr_db": 28.0}
    low = {**row, "grad_sqnr_db": 12.0}
    assert ruled_out(_row(**low, format="mxfp8"), None, math.inf) == (
        "its wgrad GEMM measures 12.0 dB against fp32, below mxfp8's 20 dB floor"
    )
    assert ruled_out(_row(**low, format="nvfp4"), None, math.inf) is None  # 12 dB is above NVFP4's 10
    assert ruled_out(_row(**{**row, "dgrad_sqnr_db": 8.5}, format="nvfp4-fwd-dgrad"), None, math.inf) == (
        "its dgrad GEMM measures 8.5 dB against fp32, below nvfp4-fwd-dgrad's 10 dB floor"
    )
    assert ruled_out(_row(**low, format="fp8-rowwise"), None, math.inf) == (
        "its wgrad GEMM measures 12.0 dB against fp32, below fp8's 20 dB floor"
    )
    assert ruled_out(_row(**low, format="fp16"), None, math.inf) is None
    assert ruled_out(_row(**row, format="mxfp8"), None, math.inf) is None


def _same(a: ProfileRow, b: ProfileRow) -> bool:
    """Equal field by field, NaN equal to NaN."""

    def eq(x, y) -> bool:
        return (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)) or x == y

    return all(eq(getattr(a, f), getattr(b, f)) for f in COLUMNS)


def _profile() -> Profile:
    rows = [
        # a layer named like a number (nn.Sequential's "0") with a 1-d weight's shape: both stay text
        _row(layer="0", shape="64", format="fp32", tokens=12.0, sqnr_db=math.inf, metric=0.9, metric_drop=0.0,
             finite=True, overflow=False, time_ms=1.0, time_spread=0.02, time_vs_fp32=1.0, timed_as="0",
             step_rise_bytes=4096.0, grad_amax=1.5, grad_amin=1e-6, grad_underflow=0.0, metric_source="measured"),
        _row(layer="0", shape="64", format="fp16", tokens=12.0, sqnr_db=60.5, grad_sqnr_db=58.0, metric=0.89,
             metric_drop=0.01, finite=True, overflow=False, max_abs=3.0, time_ms=0.7, time_vs_fp32=0.7, timed_as="0",
             scale_low_log2=2.0, scale_high_log2=14.0, metric_source="predicted: a share"),
        _row(layer="0", shape="64", format="fp8", status="unsupported", reason="no kernel, for that shape"),
        _row(layer="fc", format="bf16", timed_as="no kernel on this device", finite=False, overflow=None,
             metric_source="not measured: non-finite"),
    ]  # fmt: skip
    record = LayerGradients("0")
    record.tensors["weight_grad"].add(torch.tensor([1e-3, 1.5]))
    grad_ranges = scale_table({"0": record})
    return Profile(rows=rows, fp32_metric=0.9, metric_name="accuracy", device="cpu", fingerprint="x", grad_ranges=grad_ranges)


def test_a_saved_profile_loads_back_to_equal_rows(tmp_path):
    prof = _profile()
    prof.save(tmp_path)
    back = Profile.load(tmp_path)
    assert len(back.rows) == len(prof.rows)
    for mine, theirs in zip(prof.rows, back.rows):
        assert _same(mine, theirs), (mine, theirs)
    assert back.rows[2].tokens is None and back.rows[2].finite is None and back.rows[2].reason == "no kernel, for that shape"
    assert back.rows[3].finite is False and back.rows[3].overflow is None and back.rows[3].timed_as.startswith("no kernel")
    assert (tmp_path / "profile.csv").read_text().splitlines()[0] == ",".join(COLUMNS)


def test_a_profile_csv_missing_a_column_is_refused_naming_it(tmp_path):
    _profile().save(tmp_path)
    csv = tmp_path / "profile.csv"
    lines = csv.read_text().splitlines()
    at = COLUMNS.index("dgrad_sqnr_db")
    csv.write_text("\n".join(",".join(c for i, c in enumerate(line.split(",")) if i != at) for line in lines[:1]) + "\n")
    with pytest.raises(ValueError, match=r"profile\.csv: no column 'dgrad_sqnr_db'"):
        Profile.load(tmp_path)


def _edit(tmp_path, column: str, value: str, line: int = 2) -> None:
    """profile.csv's cell in `column` on `line` (1: the column names) set to `value`, as a person editing it would."""
    csv = tmp_path / "profile.csv"
    lines = csv.read_text().splitlines()
    cells = lines[line - 1].split(",")
    cells[COLUMNS.index(column)] = value
    lines[line - 1] = ",".join(cells)
    csv.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("column", "value", "expected"),
    [
        ("shape", "64xabc", r"column shape: '64xabc' is not a weight's sizes joined by x \(a Linear's out x in: 64x32\), or -"),
        ("shape", "64 x 32", r"column shape: '64 x 32' is not"),
        ("shape", "\u0666\u0664", r"column shape: '\u0666\u0664' is not"),
        ("tokens", "abc", r"column tokens: 'abc' is not a number or empty"),
        ("tokens", "-5", r"column tokens: -5(\.0)? is not a finite number >= 0 \(the rows the layer took per step\), or empty"),
        ("tokens", "inf", r"column tokens: inf is not a finite number >= 0"),
        ("time_ms", "fast", r"column time_ms: 'fast' is not a number or empty"),
        ("finite", "yes", r"column finite: 'yes' is not True, False or empty"),
    ],
)  # fmt: skip
def test_a_hand_edited_cell_is_refused_naming_the_file_the_line_the_layer_the_column_and_the_value(
    tmp_path, column, value, expected
):
    _profile().save(tmp_path)
    _edit(tmp_path, column, value, line=3)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'profile.csv'}: line 3 \(layer '0'\), {expected}"):
        Profile.load(tmp_path)
