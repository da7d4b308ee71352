"""autoprec/tune/_measure/_task.py: loading a model.py, the protocol checks and their messages, batch-to-device."""

from __future__ import annotations

import collections
import sys

import pytest
import torch

from autoprec.errors import UserError
from autoprec.tensors import map_tensors
from autoprec.tune._measure._metric import workload_fp32_metric
from autoprec.tune._measure._task import load_task, prepare, to_device


def user_error(fn, *args) -> str:
    """Call fn(*args), expect a UserError, and return its message."""
    with pytest.raises(UserError) as info:
        fn(*args)
    return str(info.value)


# ---- load_task ---------------------------------------------------------------------------------


def test_load_task_reads_the_functions(write_model, mlp_source):
    task = load_task(write_model(mlp_source))
    assert callable(task.build_model) and callable(task.batches) and callable(task.loss_fn)
    assert task.evaluate is None and task.optimizer is None


def test_load_task_reads_optional_functions(write_model, mlp_source):
    source = mlp_source + ("\ndef evaluate(model):\n    return 1.0\n\ndef optimizer(model):\n    return 'my optimizer'\n")
    task = load_task(write_model(source))
    assert task.evaluate(None) == 1.0
    assert task.optimizer(None) == "my optimizer"


def test_load_task_missing_file(tmp_path):
    path = tmp_path / "nowhere" / "model.py"
    msg = user_error(load_task, path)
    assert str(path) in msg and "no such file" in msg


@pytest.mark.parametrize(
    "source, expected",
    [
        ('raise RuntimeError("boom")\n', ["import failed", "RuntimeError", "boom"]),
        ("def build_model(:\n    pass\n", ["import failed", "SyntaxError"]),
        ("import no_such_module_autoprec_test\n", ["import failed", "ModuleNotFoundError", "no_such_module_autoprec_test"]),
    ],
    ids=["raises", "syntax-error", "bad-import"],
)
def test_load_task_import_fails(write_model, source, expected):
    path = write_model(source)
    msg = user_error(load_task, path)
    assert str(path) in msg
    for part in expected:
        assert part in msg


def test_load_task_can_import_its_neighbours(write_model, mlp_source):
    write_model("SIZE = 16\n", name="helpers.py")
    task = load_task(write_model("from helpers import SIZE\n" + mlp_source))
    assert task.build_model().fc1.in_features == 16


@pytest.mark.parametrize("name", ["build_model", "batches", "loss_fn"])
def test_load_task_missing_required_function(write_model, mlp_source, name):
    path = write_model(mlp_source + f"\ndel {name}\n")
    msg = user_error(load_task, path)
    assert str(path) in msg
    assert f"missing required function {name}()" in msg
    assert "build_model, batches, loss_fn" in msg  # says what model.py must define


@pytest.mark.parametrize("name", ["loss_fn", "evaluate", "optimizer"])
def test_load_task_not_callable(write_model, mlp_source, name):
    path = write_model(mlp_source + f"\n{name} = 3\n")
    msg = user_error(load_task, path)
    assert str(path) in msg
    assert f"{name} must be a function, got int" in msg


def test_load_task_leaves_sys_path_as_it_was(write_model, mlp_source):
    before = list(sys.path)
    load_task(write_model(mlp_source))
    assert sys.path == before


def test_load_task_restores_sys_path_when_the_model_edits_it(write_model, mlp_source, tmp_path):
    before = list(sys.path)
    extra = str(tmp_path / "vendor")
    try:
        load_task(write_model(f"import sys\nsys.path.insert(0, {extra!r})\n" + mlp_source))
        assert sys.path == [extra] + before
    finally:
        sys.path[:] = before


def test_load_task_model_calls_sys_exit(write_model, mlp_source):
    path = write_model("import sys\nsys.exit(3)\n" + mlp_source)
    msg = user_error(load_task, path)
    assert str(path) in msg and "SystemExit" in msg


@pytest.mark.parametrize(
    "name, addition, call",
    [
        ("build_model()", "\ndef build_model():\n    sys.exit(0)\n", lambda task, work: task.build_model()),
        (
            "loss_fn()",
            "\ndef loss_fn(model, batch):\n    sys.exit(0)\n",
            lambda task, work: task.loss_fn(work.model, work.train[0]),
        ),
        ("evaluate()", "\ndef evaluate(model):\n    sys.exit(0)\n", lambda task, work: task.evaluate(work.model)),
        ("batches()", "\ndef batches(split):\n    sys.exit(0)\n", lambda task, work: task.batches("train")),
        ("optimizer()", "\ndef optimizer(model):\n    sys.exit(0)\n", lambda task, work: task.optimizer(work.model)),
    ],
    ids=["build_model", "loss_fn", "evaluate", "batches", "optimizer"],
)
def test_sys_exit_inside_a_model_function_is_one_user_error(write_model, mlp_source, name, addition, call):
    """sys.exit(0) in build_model, loss_fn or evaluate, wherever autoprec calls it (a profile's later loss, the
    final metric), would end autoprec silently with a success code and no policy: it is a UserError naming
    the function and the file."""
    work = prepare(load_task(write_model(mlp_source)), "cpu")  # a valid workload to call the broken function on
    path = write_model("import sys\n" + mlp_source + addition, name="broken/model.py")
    task = load_task(path)
    msg = user_error(call, task, work)
    assert str(path) in msg and name in msg and "sys.exit(0)" in msg


def test_sys_exit_in_build_model_stops_prepare_with_a_user_error(write_model, mlp_source):
    path = write_model("import sys\n" + mlp_source + "\ndef build_model():\n    sys.exit(3)\n")
    msg = user_error(prepare, load_task(path), "cpu")
    assert str(path) in msg and "build_model()" in msg and "sys.exit(3)" in msg


def test_keyboard_interrupt_in_a_model_function_is_not_swallowed(write_model, mlp_source):
    path = write_model(mlp_source + "\ndef build_model():\n    raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        prepare(load_task(path), "cpu")


# ---- Task.name ---------------------------------------------------------------------------------


def test_task_name_is_the_file_stem(write_model, mlp_source):
    assert load_task(write_model(mlp_source, name="my_task.py")).name == "my_task"


def test_task_name_is_the_folder_for_model_py(write_model, mlp_source):
    assert load_task(write_model(mlp_source, name="digits/model.py")).name == "digits"


def test_task_name_for_a_relative_model_py(write_model, mlp_source, monkeypatch):
    path = write_model(mlp_source, name="digits/model.py")
    monkeypatch.chdir(path.parent)
    assert load_task("model.py").name == "digits"


# ---- prepare -----------------------------------------------------------------------------------


def test_prepare_builds_the_workload(write_model, mlp_source):
    task = load_task(write_model(mlp_source))
    work = prepare(task, "cpu")
    assert work.device == torch.device("cpu")
    assert len(work.train) == 2 and len(work.eval) == 2
    x, y = work.train[0]
    assert x.shape == (8, 16) and y.shape == (8,)
    assert all(p.dtype == torch.float32 and p.grad is None for p in work.model.parameters())


def test_prepare_allows_no_eval_batches_with_evaluate(write_model, mlp_source):
    source = mlp_source + (
        "\n_train = batches\n"
        "\ndef batches(split):\n    return _train(split) if split == 'train' else []\n"
        "\ndef evaluate(model):\n    return 0.5\n"
    )
    work = prepare(load_task(write_model(source)), "cpu")
    assert work.eval == [] and len(work.train) == 2


PREPARE_ERRORS = {
    "train-empty": (
        "\n_all = batches\ndef batches(split):\n    return [] if split == 'train' else _all(split)\n",
        ["batches('train') yields no batches"],
    ),
    "eval-empty-without-evaluate": (
        "\n_all = batches\ndef batches(split):\n    return _all(split) if split == 'train' else iter(())\n",
        ["batches('eval') yields no batches", "evaluate"],
    ),
    "batches-returns-none": (
        "\ndef batches(split):\n    return None\n",
        ["batches('train') must return an iterable", "NoneType"],
    ),
    "batches-raises": (
        "\ndef batches(split):\n    raise FileNotFoundError('data.csv')\n",
        ["batches('train') raised FileNotFoundError", "data.csv"],
    ),
    "iterating-raises": (
        "\ndef batches(split):\n    yield (torch.zeros(8, 16), torch.zeros(8, dtype=torch.long))\n    raise IOError('disk')\n",
        ["iterating batches('train') raised", "disk"],
    ),
    "loss-not-scalar": (
        "\ndef loss_fn(model, batch):\n    return model(batch[0]).sum(0)\n",
        ["loss_fn must return a scalar tensor", "shape (4,)"],
    ),
    "loss-not-tensor": (
        "\ndef loss_fn(model, batch):\n    return 1.5\n",
        ["loss_fn must return a scalar tensor", "got float"],
    ),
    "loss-raises": (
        "\ndef loss_fn(model, batch):\n    return model(batch)\n",
        ["loss_fn(model, batch) raised"],
    ),
    "loss-nan": (
        "\ndef loss_fn(model, batch):\n    return model(batch[0]).sum() * float('nan')\n",
        ["loss_fn gives nan", "fp32 model"],
    ),
    "loss-inf": (
        "\ndef loss_fn(model, batch):\n    return model(batch[0]).sum() * float('inf')\n",
        ["loss_fn gives", "inf"],
    ),
    "build-model-not-module": (
        "\ndef build_model():\n    return [nn.Linear(16, 4)]\n",
        ["build_model() must return a torch.nn.Module", "got list"],
    ),
    "build-model-fp16": (
        "\n_fp32 = build_model\ndef build_model():\n    return _fp32().half()\n",
        ["build_model() must give fp32 weights", "fc1.weight", "torch.float16"],
    ),
    "build-model-raises": (
        "\ndef build_model():\n    raise KeyError('checkpoint')\n",
        ["build_model() raised KeyError", "checkpoint"],
    ),
    # Each below used to pass prepare and fail later with a traceback, some only after the whole profile.
    "build-model-on-meta": (
        "\n_real = build_model\ndef build_model():\n    return _real().to('meta')\n",
        ["build_model()", "meta device", "fc1.weight", "load_state_dict"],
    ),
    "loss-detached": (
        "\n_loss = loss_fn\ndef loss_fn(model, batch):\n    return _loss(model, batch).detach()\n",
        ["loss_fn(model, batch)", "does not require grad", "detach"],
    ),
    "loss-int64": (
        "\ndef loss_fn(model, batch):\n    return (model(batch[0]).argmax(1) != batch[1]).sum()\n",
        ["loss_fn(model, batch)", "torch.int64", "floating-point"],
    ),
    "loss-bool": (
        "\ndef loss_fn(model, batch):\n    return (model(batch[0]).argmax(1) != batch[1]).any()\n",
        ["loss_fn(model, batch)", "torch.bool", "floating-point"],
    ),
    "loss-complex": (
        "\n_loss = loss_fn\ndef loss_fn(model, batch):\n    return _loss(model, batch) * (1 + 1j)\n",
        ["loss_fn(model, batch)", "torch.complex64", "floating-point"],
    ),
    "optimizer-given-the-model": (
        "\ndef optimizer(model):\n    return torch.optim.SGD(model, lr=0.1)\n",
        ["optimizer(model) raised TypeError", "model.parameters()"],
    ),
    "optimizer-not-an-optimizer": (
        "\ndef optimizer(model):\n    return model.parameters()\n",
        ["optimizer(model) must return a torch.optim.Optimizer", "got generator", "model.parameters()"],
    ),
    "optimizer-of-another-model": (
        "\ndef optimizer(model):\n    return torch.optim.SGD(build_model().parameters(), lr=0.1)\n",
        ["optimizer(model) optimizes none of the parameters of the model it is given", "model.parameters()"],
    ),
    "optimizer-raises": (
        "\ndef optimizer(model):\n    raise ValueError('no lr given')\n",
        ["optimizer(model) raised ValueError", "no lr given"],
    ),
}


@pytest.mark.parametrize("case", list(PREPARE_ERRORS))
def test_prepare_errors(write_model, mlp_source, case):
    addition, expected = PREPARE_ERRORS[case]
    path = write_model(mlp_source + addition)
    task = load_task(path)
    # Raised by prepare, whose workload everything else needs: before anything is profiled or measured.
    msg = user_error(prepare, task, "cpu")
    assert str(path) in msg
    for part in expected:
        assert part in msg
    assert "\n" not in msg


# ---- map_tensors / to_device -------------------------------------------------------------------

Pair = collections.namedtuple("Pair", ["inputs", "labels"])


def nested_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "pair": Pair(torch.randn(2, 3, generator=g), [torch.ones(2), "label", 7]),
        "tuple": (torch.zeros(1), None, (torch.arange(3),)),
        "mask": torch.ones(2, dtype=torch.bool),
        "meta": {"ids": [1, 2], "name": "batch0"},
    }


def test_map_tensors_reaches_every_tensor_and_keeps_structure():
    batch = nested_batch()
    out = map_tensors(batch, lambda t: t.to(torch.float64))
    assert isinstance(out, dict) and list(out) == list(batch)
    assert type(out["pair"]) is Pair
    assert out["pair"].inputs.dtype == torch.float64
    assert isinstance(out["pair"].labels, list)
    assert out["pair"].labels[0].dtype == torch.float64
    assert out["pair"].labels[1:] == ["label", 7]
    assert type(out["tuple"]) is tuple and out["tuple"][1] is None
    assert type(out["tuple"][2]) is tuple and out["tuple"][2][0].dtype == torch.float64
    assert out["mask"].dtype == torch.float64
    assert out["meta"] == {"ids": [1, 2], "name": "batch0"}
    torch.testing.assert_close(out["pair"].inputs, batch["pair"].inputs.double())
    assert batch["pair"].inputs.dtype == torch.float32  # the input is left alone


@pytest.mark.parametrize("obj", [None, 3, 2.5, "text", b"bytes", {"a": 1}, [], ()], ids=repr)
def test_map_tensors_leaves_non_tensors(obj):
    out = map_tensors(obj, lambda t: pytest.fail("called on a non-tensor"))
    assert out == obj and type(out) is type(obj)


def test_to_device_moves_every_tensor():
    out = to_device(nested_batch(), torch.device("meta"))
    tensors = [out["pair"].inputs, out["pair"].labels[0], out["tuple"][0], out["tuple"][2][0], out["mask"]]
    assert all(t.device.type == "meta" for t in tensors)
    assert out["mask"].dtype == torch.bool  # dtype kept
    assert out["pair"].labels[1:] == ["label", 7] and out["meta"]["name"] == "batch0"


def test_to_device_single_tensor():
    t = torch.ones(3)
    assert to_device(t, torch.device("cpu")) is t
    assert to_device(t, torch.device("meta")).device.type == "meta"


BATCHNORM_SOURCE = """
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))


def batches(split):
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    return [(3 * torch.randn(32, 8, generator=g) + 1, torch.randint(0, 4, (32,), generator=g)) for _ in range(2)]


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def evaluate(model):
    model.eval()
    with torch.no_grad():
        return -sum(loss_fn(model, b).item() for b in batches("eval"))
"""


def test_the_recorded_fp32_metric_is_the_users_own_evaluation_of_build_model(write_model):
    """A BatchNorm model: prepare's check of the loss ran a train-mode pass, which moved the running statistics, so
    the fp32 metric the budget is measured from was not evaluate(build_model())'s (issue 38, a U-Net)."""
    from autoprec.tune._measure._metric import checked_fp32_metric

    task = load_task(write_model(BATCHNORM_SOURCE))
    workload = prepare(task, "cpu")
    fresh = task.build_model()
    for (name, mine), theirs in zip(workload.model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(mine, theirs), name  # the running statistics too
    assert checked_fp32_metric(workload) == task.evaluate(task.build_model())


def test_the_fp32_metric_is_checked_once_for_the_budget_and_the_profile_alike(write_model, mlp_source, tmp_path):
    """A relative budget resolved it, then the profile measured it again: four evaluations where two check it."""
    log = tmp_path / "evaluations"
    source = mlp_source + f"\n\ndef evaluate(model):\n    open({str(log)!r}, 'a').write('.')\n    return 0.5\n"
    workload = prepare(load_task(write_model(source)), "cpu")
    assert workload_fp32_metric(workload) == workload_fp32_metric(workload) == 0.5
    assert log.read_text() == ".."  # evaluated twice (a metric that moves on its own is refused), then kept
