"""What every benchmark here shares: the --device flag and a header naming the device and the versions."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
from pathlib import Path

import torch

from autoprec.formats import default_device, device_name, fp8_backend
from autoprec.tune._measure._timing import Timing


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    default = str(default_device())
    parser.add_argument("--device", default=default, help=f"cpu or cuda[:N] (default here: {default})")


def parse_device(value: str) -> torch.device:
    device = torch.device(value)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {value}: CUDA is not available here; valid choices: cpu")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device must be cpu or cuda[:N], but got {value!r}")
    return device


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def print_header(title: str, device: torch.device) -> None:
    print(title)
    print(f"device: {device_name(str(device))} ({device}); fp8 runs on {fp8_backend(device)}")
    print(
        f"torch {torch.__version__}, torchao {_version('torchao')}, python {platform.python_version()}, "
        f"{torch.get_num_threads()} CPU threads"
    )


def fmt_timing(t: Timing) -> str:
    return f"{t.median_ms:9.3f} ms (spread {t.spread:.1%})"


def out_folder(doc: str | None, default: Path, root: Path) -> Path:
    """The --out folder of an experiment script (created), `default` (a committed results folder) if not given."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=default, help=f"output folder (default: {default.relative_to(root)})")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    return out
