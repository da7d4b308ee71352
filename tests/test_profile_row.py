"""autoprec/tune/_core/_profile_row.py: a row of profile.csv, its columns in order, and the cells it reads back."""

import dataclasses
import re

import pytest
import torch

from autoprec.tune._core._profile_row import _SHAPE, COLUMNS, ProfileRow


def _row(**fields) -> ProfileRow:
    return ProfileRow(**{"layer": "fc", "type": "Linear", "shape": "16x16", "status": "ok", **fields})


def test_a_row_is_a_frozen_record_of_profile_csvs_columns():
    assert [f.name for f in dataclasses.fields(ProfileRow)] == COLUMNS
    with pytest.raises(dataclasses.FrozenInstanceError):
        _row(format="bf16").status = "unsupported"  # type: ignore[misc]


def test_the_shape_the_profiler_writes_for_any_weight_passes_profile_csvs_own_check():
    """A 0-dim weight (a learned scale) was written as "" and refused when loaded back, so that model was profiled
    again on every run."""
    from autoprec.tune._measure._profiler import _shape

    scale = torch.nn.Module()
    scale.weight = torch.nn.Parameter(torch.tensor(1.0))
    written = [_shape(m) for m in (scale, torch.nn.Linear(3, 4), torch.nn.LayerNorm(5), torch.nn.ReLU())]
    assert written == ["-", "4x3", "5", "-"] and all(re.fullmatch(_SHAPE, w) for w in written)


def test_a_cell_is_read_back_as_written_and_a_stray_one_is_refused_naming_its_column():
    cells = {c: None for c in COLUMNS} | {"layer": "fc", "type": "Linear", "shape": "16x16", "format": "bf16", "status": "ok"}
    row = ProfileRow.from_cells(cells | {"sqnr_db": "41.5", "finite": "True", "tokens": "64"})
    assert row.sqnr_db == 41.5 and row.finite is True and row.tokens == 64 and row.format == "bf16"
    with pytest.raises(ValueError, match=r"^column sqnr_db: 'loud' is not a number or empty$"):
        ProfileRow.from_cells(cells | {"sqnr_db": "loud"})
