"""`autoprec profile`: each layer's sensitivity, gradient ranges and speed in each format, on its own."""

from __future__ import annotations

import argparse

from autoprec.tune._commands._shared import Verb, model_arguments, model_device, out_dir, prepare_model, print_json
from autoprec.tune._core._config import ProfileConfig, compile_setting
from autoprec.tune._measure._profiler import profile
from autoprec.tune._report._plots import plot_all
from autoprec.tune._report._report import breaks, breaks_summary, gradient_summary, profile_summary
from autoprec.tune._search._out_dir import claim_out_dir


def cmd_profile(args: argparse.Namespace) -> int:
    device = model_device(args)
    compiled = compile_setting(args.compile, device)
    task, space, workload = prepare_model(args, device, compiled=compiled)
    out = out_dir(args, task)
    with claim_out_dir(workload, out):
        prof = profile(workload, space, ProfileConfig(compile=compiled), progress=not args.quiet)
        path = prof.save(out)
        pngs = plot_all(prof, out, title=f"{task.name} on {prof.device}")
    if args.json:
        found = [b.to_dict() for b in breaks(prof.rows)]
        print_json(
            args,
            {
                "profile_csv": str(path),
                "device": prof.device,
                "fp32_metric": prof.fp32_metric,
                "metric": prof.metric_name,
                "breaks": found,
            },
        )
        return 0
    if args.quiet:
        return 0
    print(profile_summary(prof.rows))
    print()
    print(gradient_summary(prof.rows, prof.advice()))
    names = ", ".join(p.name for p in [path.with_name("profile.json"), path.with_name("grad_ranges.csv"), *pngs])
    print(f"\nfp32 metric {prof.fp32_metric:.6g} ({prof.metric_name}) on {prof.device}; wrote {path}, {names}")
    print()
    print(breaks_summary(prof.rows))  # last: the short answer to "which layer breaks?"
    return 0


PROFILE = Verb(
    "profile",
    "measure each layer's sensitivity, gradient ranges and speed in each format; write profile.csv, grad_ranges.csv and heat maps",
    model_arguments,
    cmd_profile,
)
