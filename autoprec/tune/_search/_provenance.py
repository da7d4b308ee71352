"""The provenance record: the policy file's `measured` block (records.Measured), what a policy was measured on and
against: the device, the versions, the model's fingerprint, the budget and mode, the noise floor, the re-measured
results of the policy and of the alternatives, and how the timing was taken.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
from collections.abc import Mapping

import optuna
import torch

from autoprec import devices
from autoprec.apply import fp8_backend
from autoprec.devices import float32_matmul_precision
from autoprec.formats import device_name
from autoprec.policy import model_fingerprint
from autoprec.tune._core import _memory as memory
from autoprec.tune._core._config import FINAL_SHARE, SETTLED, SETTLED_FINAL_ROUNDS, Mode, SearchConfig
from autoprec.tune._core._names import ALTERNATIVES
from autoprec.tune._core._records import Finals, Measured, Result, StudyRef
from autoprec.tune._decide._trials import complete_count
from autoprec.tune._measure._task import Workload
from autoprec.tune._search._plan import Started


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "optuna": optuna.__version__}
    for dist in ("torchao", "autoprec"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def measured_record(
    workload: Workload,
    started: Started,
    config: SearchConfig,
    finals: Finals,
    best_name: str,
    budget: float,
    *,
    compared: Mapping[str, str] | None = None,
    notes: Mapping[str, str] | None = None,
) -> Measured:
    """The policy file's `measured`: the device, versions, budget, and the re-measured results of the policy
    and of `compared` (label -> candidate in `finals`; default the alternatives measured, under their own
    names); `notes`: alternatives not measured, and why."""
    compared = compared or {name: name for name in ALTERNATIVES if name in finals.names}
    prof, choices, judge, study = started.profile, started.choices, started.judge, started.study
    train = config.mode is Mode.TRAIN

    def result(name: str) -> Result:
        r = Result.of(finals.by_name(name))
        return r if train else dataclasses.replace(r, train_skipped_steps=None)

    kept = {
        n: "; ".join(f"{f}: {r}" for f, r in choices.excluded.get(n, {}).items())
        for n, o in choices.layers.items()
        if o == ("fp32",)
    }
    return Measured(
        device=device_name(str(workload.device)),
        versions=_versions(),
        model=workload.task.name,
        fingerprint=model_fingerprint(workload.model),
        budget=budget,
        mode=config.mode.value,
        train_steps=config.train_steps if train else None,
        noise_floor=judge.noise.spread if judge.noise else None,
        noise=judge.noise.to_dict() if judge.noise else None,
        fp32_metric=judge.fp32_metric,
        metric=prof.metric_name,
        chosen=best_name,
        results={**{label: result(name) for label, name in compared.items()}, "policy": result(best_name)},
        kept_fp32=kept,
        excluded={n: dict(r) for n, r in choices.excluded.items()},
        fp8=fp8_backend(workload.device),
        compiled=config.compile,
        alternatives_not_measured=dict(notes or {}),
        # on a device with TF32 (CUDA) every candidate but TF32 ran strict (trainer.matmul_precision); elsewhere the
        # process's setting for that device's backend
        float32_matmul_precision="highest"
        if devices.lookup(workload.device).has_tf32
        else float32_matmul_precision(workload.device.type),
        timing=(
            (
                "compiled after apply_policy (each repeated block, else the whole model), compilation excluded (warm-up); "
                if config.compile
                else "eager; "
            )
            + f"median of {max((r.rounds for r in finals), default=0)} interleaved rounds (up to {config.final_timing.rounds}, "
            f"stopped after {SETTLED_FINAL_ROUNDS} once every spread was within {SETTLED:.0%}; up to twice as many where "
            f"they stay noisy on a device the trials found quiet, within {FINAL_SHARE:.0%} of the search's time); spread = interquartile range / median; "
            "effective_step_ms = step_ms / (1 - skipped / steps): steps the GradScaler skipped update nothing"
        ),
        memory=memory.source(workload.device) or memory.not_measured(workload.device),
        max_memory=config.max_memory,
        objective=config.objective.name,
        loss_scale_search=dict(choices.loss_scale or {}),
        search_space=choices.describe(),
        study=StudyRef(name=study.study_name, storage=started.storage, trials=len(study.trials), complete=complete_count(study)),
        layout=workload.sharding.layout() if workload.sharding is not None else None,
        coverage=started.coverage.to_dict() if started.coverage is not None else None,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
