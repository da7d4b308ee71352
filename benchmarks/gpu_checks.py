"""Issue 36's fixes checked on a real GPU: what the CPU suite's --gpu-contract stands in for, run on CUDA itself.

    python benchmarks/gpu_checks.py --out results/<gpu>/checks      # on the device machine; a minute or two

Writes checks.json and summary.md:
- the README's training loop (apply_policy, grad_scaler, AdamW) over batches of 256, 256 and 157 rows and a call
  with no rows, for every fp8 format in an fp32 and a bf16 root, eager; and compiled (inductor) for two formats;
- each fp8 format's three GEMMs' SQNR against fp32 on CUDA's kernels beside the CPU's emulation (the same seeded
  layer): within 0.5 dB is the promise;
- TF32 set through torch's new API, then autoprec's strict/TF32 step context;
- what padding a ragged batch costs: a training step at 4095 rows (padded to 4096) against 4096 rows, fp8, timed
  interleaved with CUDA events.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import autoprec  # noqa: E402
from autoprec.formats import fp8_formats  # noqa: E402
from autoprec.tune._measure._metric import sqnr_db  # noqa: E402
from autoprec.tune._measure._trainer import matmul_precision  # noqa: E402

FP8 = [f.value for f in fp8_formats() if f.family.fp8_gemms(f) is not None]


class Mlp(nn.Module):
    def __init__(self, width: int = 256):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.head = nn.Linear(64, width), nn.Linear(width, width), nn.Linear(width, 16)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def readme_loop(fmt: str, root: str, device: str, compiled: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randn(n, 64, generator=g), torch.randint(0, 16, (n,), generator=g)) for n in (256, 256, 157)]
    policy = autoprec.Policy(layers={"": root, "fc1": fmt, "fc2": fmt})
    model = autoprec.apply_policy(Mlp().to(device), policy)
    backend = str(autoprec.applied_summary(model).fp8_backends().get("fc1"))
    scaler = autoprec.grad_scaler(policy, model=model)
    if compiled:
        model = autoprec.compile_model(model)
    optimizer = torch.optim.AdamW(model.parameters())
    began = time.perf_counter()
    losses = []
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(float(loss))
    empty = model(torch.randn(0, 64, device=device))
    torch.cuda.synchronize()
    return {"losses": losses, "empty_shape": list(empty.shape), "backend": backend, "seconds": time.perf_counter() - began}


def gemm_sqnrs(fmt: str, root: str, device: str) -> dict:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(256, 512)).to(device)
    low = autoprec.apply_policy(copy.deepcopy(ref), autoprec.Policy(layers={"": root, "0": fmt}))
    x = torch.randn(64, 256).to(device)
    x_ref, x_low = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(x_ref)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=root == "bf16"):
        y = low(x_low)
    grad_out = torch.randn(y_ref.shape).to(device)
    y_ref.backward(grad_out)
    y.float().backward(grad_out)
    return {
        "fprop": sqnr_db(y_ref.cpu(), y.float().cpu()),
        "dgrad": sqnr_db(x_ref.grad.cpu(), x_low.grad.float().cpu()),
        "wgrad": sqnr_db(ref[0].weight.grad.cpu(), low[0].weight.grad.cpu()),
    }


def pad_cost(device: str, rounds: int = 30) -> dict:
    """Median step ms at 4096 rows and at 4095 (padded), fp8 in a bf16 root, 2048-wide Linears, interleaved."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048)).to(device)
    model = autoprec.apply_policy(net, autoprec.Policy(layers={"": "bf16", "0": "fp8", "2": "fp8"}))
    optimizer = torch.optim.AdamW(model.parameters())
    batches = {n: torch.randn(n, 2048, device=device) for n in (4096, 4095)}

    def step(x):
        optimizer.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        optimizer.step()

    for x in batches.values():
        for _ in range(3):
            step(x)
    samples: dict[int, list[float]] = {n: [] for n in batches}
    for _ in range(rounds):
        for n, x in batches.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                step(x)
            end.record()
            torch.cuda.synchronize()
            samples[n].append(start.elapsed_time(end) / 5)
    med = {n: statistics.median(v) for n, v in samples.items()}
    return {"ms_4096": med[4096], "ms_4095_padded": med[4095], "ratio": med[4095] / med[4096]}


def tf32_new_api(device: str) -> dict:
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        with matmul_precision(torch.device(device), tf32=False):
            inside = matmul.fp32_precision
            a = torch.randn(256, 256, device=device)
            (a @ a).sum().item()
        return {"inside_strict": inside, "restored": matmul.fp32_precision}
    finally:
        matmul.fp32_precision = before


def run(name: str, fn, results: dict) -> None:
    began = time.perf_counter()
    try:
        results[name] = {"ok": True, **fn()}
    except Exception as exc:
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-1500:]}
    results[name]["wall_s"] = round(time.perf_counter() - began, 2)
    print(f"gpu_checks: {name}: {'ok' if results[name]['ok'] else results[name]['error']}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_checks: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = "cuda"
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for root in ("fp32", "bf16"):
        for fmt in FP8:
            run(f"loop {fmt} in {root}", lambda fmt=fmt, root=root: readme_loop(fmt, root, device), results)
    for fmt in ("fp8", "fp8-rowwise"):
        run(f"compiled loop {fmt} in bf16", lambda fmt=fmt: readme_loop(fmt, "bf16", device, compiled=True), results)
    for root in ("fp32", "bf16"):
        for fmt in FP8:

            def both(fmt=fmt, root=root):
                gpu, cpu = gemm_sqnrs(fmt, root, device), gemm_sqnrs(fmt, root, "cpu")
                diff = {g: abs(gpu[g] - cpu[g]) if gpu[g] != cpu[g] else 0.0 for g in gpu}
                return {"cuda_db": gpu, "cpu_db": cpu, "max_diff_db": max(diff.values())}

            run(f"sqnr {fmt} in {root}", both, results)
    run("tf32 through the new API", lambda: tf32_new_api(device), results)
    run("ragged batch padding cost", lambda: pad_cost(device), results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checks.json").write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    lines = [f"# gpu_checks on {results['device']} (torch {results['torch']})", "",
             f"`python benchmarks/gpu_checks.py --out {args.out}`", "", "| check | result |", "|---|---|"]  # fmt: skip
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        if not r["ok"]:
            text = "FAILED: " + r["error"].replace("|", "\\|")[:200]
        elif "max_diff_db" in r:
            text = f"CUDA vs CPU within {r['max_diff_db']:.2f} dB (fprop {r['cuda_db']['fprop']:.1f} dB on CUDA)"
        elif "ratio" in r:
            text = f"4095 rows (padded) {r['ms_4095_padded']:.3f} ms against 4096 rows {r['ms_4096']:.3f} ms: {r['ratio']:.3f}x"
        elif "losses" in r:
            text = f"{r['backend']}; finite losses {['%.3f' % v for v in r['losses']]}; no-row call {r['empty_shape']}"
        else:
            text = json.dumps({k: v for k, v in r.items() if k not in ("ok", "wall_s")})
        lines.append(f"| {name} | {text} |")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0 if all(r["ok"] for r in results.values() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
