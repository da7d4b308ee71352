"""The bundled examples keep the model.py contract, and a committed policy holds its budget when applied."""

from pathlib import Path

import pytest

from autoprec import apply_policy, load_policy, load_task, prepare
from autoprec.measure import metric_of

ROOT = Path(__file__).parents[1]
DIGITS = ROOT / "examples" / "digits" / "model.py"


@pytest.fixture(scope="module")
def digits(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("AUTOPREC_CACHE", str(tmp_path_factory.mktemp("cache")))
    return prepare(load_task(DIGITS), "cpu")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_digits_follows_the_contract(digits):
    task = digits.task
    assert task.name == "digits" and task.evaluate is not None
    again = task.batches("train")
    assert all((a[0] == b[0]).all() for a, b in zip(again, digits.train))
    with pytest.raises(ValueError, match="split"):
        task.batches("test")
    assert metric_of(digits, digits.model) >= 0.95  # build_model trains to a useful metric


@pytest.mark.parametrize("policy_path", sorted(ROOT.glob("results/*/digits/policy.json")), ids=lambda p: p.parts[-3])
def test_committed_digits_policy_holds_its_budget_on_a_fresh_model(digits, policy_path):
    policy = load_policy(policy_path)
    fp32 = metric_of(digits, digits.task.build_model())
    lowered = metric_of(digits, apply_policy(digits.task.build_model(), policy))
    assert fp32 - lowered <= policy.measured["budget"]


def test_moe12_has_109_tunable_linears_in_8_roles_and_keeps_the_contract(monkeypatch):
    # The untrained model (build_model trains for minutes): its structure is what the layouts depend on.
    from autoprec.choices import role
    from autoprec.space import load_space

    monkeypatch.syspath_prepend(str(ROOT / "examples" / "tinylm"))
    import moe12

    model = moe12.MoE12()
    layers = load_space().tunable_layers(model)
    assert len(layers) == 109 and all(type(m).__name__ == "Linear" for n, m in model.named_modules() if n in layers)
    # q, k, v, o, router, the experts' up and down (both experts share a role), head
    assert len({role(n) for n in layers}) == 8
    train, evals = moe12.batches("train"), moe12.batches("eval")
    assert len(train) == 8 and len(evals) == 4 and train[0][0].shape == (16, 64)
    loss = moe12.loss_fn(model, train[0])
    assert loss.ndim == 0 and 5.0 < loss.item() < 6.0  # about ln(256) before training
