"""What every part of the block study shares: the GPT-2 example and its Linears' roles, the formats, the output paths,
the figures' pyplot, and summary.md with one section a part.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from autoprec.formats.mx import MXFP8, NVFP4

from . import ROOT

GPT2 = ROOT / "examples" / "gpt2" / "model.py"
DEFAULT_OUT = ROOT / "results" / "cpu-epyc-bf16-2core" / "block-study"
GEMMS = ("fprop", "dgrad", "wgrad")
ROLES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "lm_head")
# the parts, each a module of this package with its run(args), in the order of their sections in summary.md: the
# second horizon attempt, the re-pricing of its policies and the schedules (issue 63) before the first, retired horizon
PARTS = ("sqnr", "drop", "search", "horizon2", "reprice", "schedule", "horizon")


@dataclass(frozen=True)
class Float8Tensorwise:
    """torchao's `tensorwise` float8 training recipe, emulated in plain torch: every operand scaled per tensor
    (dynamic: scale = max(dtype) / max(amax, 1e-12), computed in fp64 then rounded to fp32), multiplied, saturated to
    +-max(dtype), cast (round to nearest even) and divided by the scale again. Operand dtypes as torchao 0.18's
    Float8LinearConfig() (= from_recipe_name("tensorwise")) leaves them: input and weight float8_e4m3fn, grad_output
    float8_e5m2 (torchao/float8/config.py, Float8LinearConfig.__post_init__: the `default_dtype` of each operand).
    Per-tensor scaling makes each operand one tensor for both GEMMs it feeds, so no blocking dimension matters."""

    activation: torch.dtype = torch.float8_e4m3fn
    weight: torch.dtype = torch.float8_e4m3fn
    gradient: torch.dtype = torch.float8_e5m2

    def quantize(self, t: torch.Tensor, role: str) -> torch.Tensor:
        dtype = getattr(self, role)
        fmax = torch.finfo(dtype).max
        t = t.float()
        scale = (fmax / t.abs().amax().double().clamp(min=1e-12)).float()
        return (t * scale).clamp(-fmax, fmax).to(dtype).float() / scale


# name -> the format of all three GEMMs. MXFP8: E4M3 elements for all operands, rceil scales (Blackwell's cuBLAS /
# Transformer Engine rule). NVFP4: weights in 16x16 tiles and a dynamic per-tensor second-level scale throughout;
# `nvfp4` rounds everything to nearest and has no RHT, `nvfp4-rht` adds the 16x16 random Hadamard transform to the
# wgrad operands, `nvfp4-rht-sr` also rounds gradients stochastically (NVIDIA's training recipe, NVFP4()'s defaults).
FORMATS = {
    "fp8-tensorwise": Float8Tensorwise(),
    "mxfp8": MXFP8(),
    "nvfp4": NVFP4(stochastic_gradients=False, rht=False),
    "nvfp4-rht": NVFP4(stochastic_gradients=False),
    "nvfp4-rht-sr": NVFP4(),
}


def _pyplot():
    """matplotlib's pyplot on the file-only backend (no display on a server), imported when a figure is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    """Lay the figure out, write it to `path` and free it: every figure of the study the same way."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_example(size: str):
    """examples/gpt2/model.py imported with AUTOPREC_GPT2_SIZE=size (the module reads it on import)."""
    old = os.environ.get("AUTOPREC_GPT2_SIZE")
    os.environ["AUTOPREC_GPT2_SIZE"] = size
    try:
        spec = importlib.util.spec_from_file_location(f"gpt2_example_{size}", GPT2)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if old is None:
            del os.environ["AUTOPREC_GPT2_SIZE"]
        else:
            os.environ["AUTOPREC_GPT2_SIZE"] = old
    return module


def layer_role(name: str) -> tuple[int, str]:
    """(block index, role) of a Linear of the GPT example: h.3.attn.c_attn -> (3, attn.c_attn); the MLP's Linears
    sit on the block itself (h.3.c_fc, h.3.c_proj); lm_head -> (-1, lm_head)."""
    parts = name.split(".")
    if parts[0] == "h":
        rest = ".".join(parts[2:])
        return int(parts[1]), rest if rest.startswith("attn.") else f"mlp.{rest}"
    return -1, name


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def write_csv(path: Path, rows: list[dict]) -> None:
    """The rows as a csv with a header: every key any row has, in the order first seen; a row without one leaves its
    cell empty."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)), restval="")
        writer.writeheader()
        writer.writerows(rows)


def update_summary(out: Path, part: str, section: str) -> None:
    """summary.md holds one section per part, in PARTS order; a part rewrites its own and keeps the others."""
    path = out / "summary.md"
    sections = {}
    if path.exists():
        for m in re.finditer(r"<!-- part:(\w+) -->\n(.*?)<!-- /part:\1 -->\n", path.read_text(), re.DOTALL):
            sections[m.group(1)] = m.group(2)
    sections[part] = section.rstrip("\n") + "\n"
    text = [
        "# Block study (issue 41): which layers tolerate which low-precision formats, by block depth",
        "",
        f"CPU: {_cpu()}; torch threads: {torch.get_num_threads()}; torch {torch.__version__}, python "
        f"{platform.python_version()}. Each section below says the command that wrote it; docs/block-study.md "
        "explains the study.",
        "",
    ]
    for name in PARTS:
        if name in sections:
            text += [f"<!-- part:{name} -->", sections[name] + f"<!-- /part:{name} -->", ""]
    path.write_text("\n".join(text))


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
