"""Shared fixtures: write a model.py from a source string, and a tiny valid model.py to start from.

Tests build broken variants of the tiny model by appending to its source: a later `def` replaces
an earlier one and `del name` removes a function, so each test shows only what it breaks:

    path = write_model(mlp_source + "\\ndef batches(split):\\n    return []\\n")
"""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Callable
from pathlib import Path

import gpu_contract
import pytest
from timings import MODES, FormatClock, using

# A valid model.py: Linear(16, 32) -> ReLU -> Linear(32, 32) -> Linear(32, 4), named fc1, act, fc2,
# head; two seeded batches of 8 per split; cross-entropy loss; no evaluate, so the default metric
# (-(mean eval loss)) applies.
MLP_SOURCE = '''\
"""A tiny MLP task for autoprec's tests: 16 features -> 4 classes, deterministic batches."""
from collections import OrderedDict

import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(
        fc1=nn.Linear(16, 32), act=nn.ReLU(), fc2=nn.Linear(32, 32), head=nn.Linear(32, 4),
    ))


def batches(split):
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
'''


@pytest.fixture
def mlp_source() -> str:
    """The source of a small valid model.py (see MLP_SOURCE); append to it to break one thing."""
    return MLP_SOURCE


@pytest.fixture
def write_model(tmp_path: Path) -> Callable[..., Path]:
    """`write_model(source, name="model.py")` writes `source` (dedented) under tmp_path and returns its path.

    `name` may include folders ("digits/model.py"); they are created.
    """

    def write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
        return path

    return write


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--timings", choices=sorted(MODES), default="faster",
        help="the device the suite's step times come from (tests/timings.py): 'faster' (every lowered format faster than "
        "fp32, as on a GPU) or 'slower' (every one slower, as on an AVX2-only CPU); every test must pass under both",
    )  # fmt: skip
    parser.addoption(
        "--gpu-contract", action="store_true",
        help="run every test under CUDA's rules (tests/gpu_contract.py): fp8 through torchao's kernel path and CUDA's "
        "torch._scaled_mm checks, torchao reading autocast as on CUDA, TF32 set through torch's new API",
    )  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def session_contract(request: pytest.FixtureRequest):
    """`--gpu-contract`: the whole session under CUDA's rules (tests/gpu_contract.py)."""
    with gpu_contract.enforced() if request.config.getoption("--gpu-contract") else contextlib.nullcontext():
        yield


@pytest.fixture
def gpu_contract_on(request: pytest.FixtureRequest):
    """This test under CUDA's rules (tests/gpu_contract.py), whatever the session's option."""
    with contextlib.nullcontext() if request.config.getoption("--gpu-contract") else gpu_contract.enforced():
        yield


@pytest.fixture
def no_gpu_contract():
    """This test of a CPU's own behaviour (torchao's emulation, a CPU's refusals) without CUDA's rules, whatever the
    session's option."""
    with gpu_contract.lifted():
        yield


@pytest.fixture(scope="session", autouse=True)
def device_timings(request: pytest.FixtureRequest):
    """Every step time of the session comes from a FormatClock (tests/timings.py), never from this machine's speed."""
    with using(FormatClock(MODES[request.config.getoption("--timings")])) as clock:
        yield clock


@pytest.fixture
def timings(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FormatClock]:
    """`timings("faster" | "slower" | factors, noise=0.0, seed=0)` makes this test's step times come from that device:
    for a test whose assertion needs lowered formats faster (or slower) than fp32."""
    from autoprec.tune._measure import _timing as timing

    def use(mode: str | dict[str, float], *, noise: float = 0.0, seed: int = 0) -> FormatClock:
        clock = FormatClock(MODES[mode] if isinstance(mode, str) else mode, noise=noise, seed=seed)
        monkeypatch.setattr(timing, "CLOCK", clock)
        return clock

    return use


@pytest.fixture
def one_rank(tmp_path):
    """torch.distributed's default group of one rank in this process (gloo, a file store): a Ranks of one, the
    leader, to run the operations' bookkeeping in-process; a mesh of one for FSDP2."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
