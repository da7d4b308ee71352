"""The bundled examples keep the model.py contract, and a committed policy holds its budget when applied."""

from pathlib import Path

import pytest

from autoprec import apply_policy, load_policy
from autoprec.tune import load_task, prepare
from autoprec.tune._measure._metric import metric_of

ROOT = Path(__file__).parents[1]
DIGITS = ROOT / "examples" / "digits" / "model.py"


@pytest.fixture(scope="module")
def digits(tmp_path_factory, monkeypatch_module):
    pytest.importorskip("sklearn", reason="the digits example loads scikit-learn's bundled data (the test extra has it)")
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


COMMITTED_DIGITS = sorted(ROOT.glob("results/*/digits/policy.json"))


def test_the_committed_digits_policies_are_found():
    """Without this, moving results/ would turn the next test into a silent skip (an empty parameter set)."""
    assert COMMITTED_DIGITS, "no results/*/digits/policy.json: the committed runs moved or were removed"


@pytest.mark.parametrize("policy_path", COMMITTED_DIGITS, ids=lambda p: p.parts[-3])
def test_committed_digits_policy_holds_its_budget_on_a_fresh_model(digits, policy_path):
    policy = load_policy(policy_path)
    fp32 = metric_of(digits, digits.task.build_model())
    lowered = metric_of(digits, apply_policy(digits.task.build_model(), policy))
    assert fp32 - lowered <= policy.measured["budget"]


@pytest.mark.slow
def test_moe12_has_109_tunable_linears_in_8_roles_and_keeps_the_contract(monkeypatch):
    # The untrained model (build_model trains for minutes): its structure is what the layouts depend on.
    from autoprec.tune._core._space import load_space
    from autoprec.tune._measure._choices import role

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


@pytest.mark.slow
def test_minilm_is_the_minilm_l6_shape_with_37_linears_and_keeps_the_contract():
    # The untrained encoder (build_model trains for minutes): its structure is what the search-cost case needs.
    import torch

    from autoprec.tune._core._space import load_space

    pytest.importorskip("transformers")
    task = load_task(ROOT / "examples" / "minilm" / "model.py")  # build_model is not called
    module = __import__("sys").modules[task.build_model.__module__]
    torch.manual_seed(0)
    model = module.Encoder()
    layers = load_space().tunable_layers(model)
    assert len(layers) == 37 and len(model.bert.encoder.layer) == 6 and model.head.in_features == 384
    train, evals = module.batches("train"), module.batches("eval")
    assert len(train) == len(evals) == 4 and train[0]["query"].shape == train[0]["key"].shape == (32, 48)
    assert torch.equal(train[0]["query"][:, 12:], train[0]["key"][:, :36])  # the key: the window 12 bytes on
    loss = task.loss_fn(model, train[0])
    assert loss.ndim == 0 and torch.isfinite(loss) and loss.item() > 2.0  # about ln(32) before training
    accuracy = task.evaluate(model.eval())
    assert accuracy in {i / 128 for i in range(129)}  # top-1 over the 128 eval queries


GPT2 = ROOT / "examples" / "gpt2" / "model.py"


@pytest.fixture(scope="module")
def gpt2_tiny(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("AUTOPREC_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch_module.setenv("AUTOPREC_GPT2_SIZE", "tiny")
    return prepare(load_task(GPT2), "cpu")


def test_gpt2_small_is_the_gpt2_small_architecture_with_a_byte_vocabulary(monkeypatch):
    import torch

    monkeypatch.delenv("AUTOPREC_GPT2_SIZE", raising=False)
    task = load_task(GPT2)  # imports the module; build_model (minutes of training) is not called
    module = __import__("sys").modules[task.build_model.__module__]
    model = module.GPT()
    assert module.SIZE == "small" and len(model.h) == 12 and model.wte.embedding_dim == 768
    assert 84e6 < sum(p.numel() for p in model.parameters()) < 87e6  # 124M less GPT-2's 50257-token embedding
    assert model.lm_head.weight is model.wte.weight  # tied, as in GPT-2
    assert len([m for m in model.modules() if isinstance(m, torch.nn.Linear)]) == 49


def test_gpt2_refuses_an_unknown_size(monkeypatch):
    monkeypatch.setenv("AUTOPREC_GPT2_SIZE", "huge")
    with pytest.raises(Exception, match=r"AUTOPREC_GPT2_SIZE must be one of tiny, mini, small, 1b, but got 'huge'"):
        load_task(GPT2)


@pytest.mark.slow
def test_a_policy_applied_then_compiled_trains_without_recompiling_after_the_first_step(gpt2_tiny):
    """The README's order on the GPT example: apply_policy, torch.compile(model), train; the first step compiles
    and none after it recompiles (lowered layers, an fp8 layer and a bf16 root included)."""
    import torch
    import torch._dynamo

    from autoprec import Policy

    torch._dynamo.reset()
    policy = Policy(layers={"": "bf16", "h.0.c_fc": "fp8", "h.1.attn.c_attn": "fp32", "lm_head": "bf16"})
    model = torch.compile(apply_policy(gpt2_tiny.task.build_model(), policy).train())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = gpt2_tiny.task.loss_fn(model, batch)
        loss.backward()
        opt.step()
        return loss.item()

    losses = [step(gpt2_tiny.train[0])]
    with torch._dynamo.config.patch(error_on_recompile=True):
        losses += [step(b) for b in gpt2_tiny.train * 2]
    assert all(torch.isfinite(torch.tensor(losses)))
    torch._dynamo.reset()


HF_GPT2 = ROOT / "examples" / "hf_gpt2"


@pytest.mark.slow
def test_the_hf_gpt2_example_searches_conv1d_with_the_natural_loss_and_trains_under_trainer(monkeypatch, tmp_path):
    """The untrained model (build_model trains for a minute): the contract, GPT-2's Conv1D layers in the default
    space, and train.py's PolicyTrainer run with an fp16 layer, whose GradScaler is on."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch

    from autoprec import Policy
    from autoprec.tune._core._space import load_space

    task = load_task(HF_GPT2 / "model.py")
    example = __import__("sys").modules[task.build_model.__module__]
    model = example.untrained()
    layers = load_space().tunable_layers(model)
    assert sum(type(m).__name__ == "Conv1D" for n, m in model.named_modules() if n in layers) == 8 and "lm_head" in layers
    train = task.batches("train")
    assert len(train) == 4 and set(train[0]) == {"input_ids", "labels"} and train[0]["input_ids"].shape == (16, 64)
    loss = task.loss_fn(model, train[0])
    assert loss.ndim == 0 and 5.0 < loss.item() < 6.0  # about ln(256) before training
    import importlib.util

    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("hf_gpt2_train", HF_GPT2 / "train.py")  # no bare `train` module
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    policy = Policy(layers={"": "bf16", "transformer.h.0.mlp.c_fc": "fp16"})
    trainer = script.train(policy, 2, model=model)
    assert trainer.autoprec_scaler.is_enabled() and trainer.state.global_step == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_hf_bert_example_keeps_the_contract_with_dict_batches_and_an_accuracy():
    """The untrained classifier (build_model trains for a minute): the contract and its layers."""
    pytest.importorskip("transformers")
    from autoprec.tune._core._space import load_space

    task = load_task(ROOT / "examples" / "hf_bert" / "model.py")
    example = __import__("sys").modules[task.build_model.__module__]
    model = example.untrained()
    assert len(load_space().tunable_layers(model)) == 2 * 6 + 2  # per block q, k, v, out, up, down; pooler, classifier
    train = task.batches("train")
    assert len(train) == 4 and set(train[0]) == {"input_ids", "labels"} and train[0]["input_ids"].shape == (32, 64)
    assert [b["labels"].tolist() for b in task.batches("eval")] == [b["labels"].tolist() for b in task.batches("eval")]
    loss = task.loss_fn(model, train[0])
    assert loss.ndim == 0 and 1.0 < loss.item() < 2.0  # about ln(4) before training
    model.eval()
    assert 0.0 <= task.evaluate(model) <= 1.0


def test_the_hf_bert_example_trains_under_hf_trainer_with_default_arguments_and_a_policy(tmp_path):
    pytest.importorskip("accelerate")
    import torch
    import transformers

    from autoprec import Policy
    from autoprec.integrations.transformers import PolicyTrainer

    task = load_task(ROOT / "examples" / "hf_bert" / "model.py")
    model = __import__("sys").modules[task.build_model.__module__].untrained()
    rows = [{"input_ids": ids, "labels": label} for b in task.batches("train") for ids, label in zip(b["input_ids"], b["labels"])]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to=[])  # defaults otherwise
    policy = Policy(layers={"": "bf16", "classifier": "fp32", "bert.encoder.layer.0.intermediate.dense": "fp16"})
    trainer = PolicyTrainer(policy=policy, model=model, args=args, train_dataset=rows)
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.autoprec_scaler.is_enabled()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow
def test_the_lightning_example_trains_the_digits_model_under_the_plugin(digits, monkeypatch, tmp_path):
    pytest.importorskip("lightning")
    import importlib.util

    import torch

    from autoprec import Policy

    spec = importlib.util.spec_from_file_location("digits_lightning", ROOT / "examples" / "digits" / "train_lightning.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.chdir(tmp_path)
    net = digits.task.build_model()
    module, plugin = script.fit(Policy(layers={"": "bf16", "fc1": "fp16"}), 2, net=net)
    assert module.net is net and "forward" in net.fc1.__dict__  # the policy is on self.net, as submodule="net" says
    assert plugin.scaler.is_enabled() and all(torch.isfinite(p).all() for p in net.parameters())


LLAMA = ROOT / "examples" / "llama" / "model.py"


def test_llama_full_is_the_stated_llama_architecture(monkeypatch):
    import sys

    import torch

    monkeypatch.delenv("AUTOPREC_LLAMA_SIZE", raising=False)
    task = load_task(LLAMA)  # imports the module; build_model (training) is not called
    module = sys.modules[task.build_model.__module__]
    with torch.device("meta"):  # its shapes without 1.5 GB of weights
        model = module.Llama()
    h = module.HPARAMS
    assert module.SIZE == "full" and (h["seq_len"], h["batch"]) == (2048, 8) and len(model.layers) == 6
    assert 360e6 < sum(p.numel() for p in model.parameters()) < 370e6
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features) == (2048, 512, 512)  # 4 KV heads
    assert (mlp.gate_proj.out_features, mlp.up_proj.out_features, mlp.down_proj.in_features) == (8192, 8192, 8192)
    assert isinstance(model.norm, module.RMSNorm) and not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())


def test_llama_tiny_takes_a_training_step_with_a_policy_applied(monkeypatch):
    import sys

    import torch

    from autoprec import Policy

    monkeypatch.setenv("AUTOPREC_LLAMA_SIZE", "tiny")
    task = load_task(LLAMA)
    module = sys.modules[task.build_model.__module__]
    torch.manual_seed(0)
    policy = Policy(layers={"": "bf16", "layers.0.mlp.up_proj": "fp8", "lm_head": "fp32"})
    model = apply_policy(module.Llama(), policy).train()
    batch = task.batches("train")[0]
    assert batch[0].shape == (8, 64)
    loss = task.loss_fn(model, batch)
    loss.backward()
    assert torch.isfinite(loss) and 4.0 < loss.item() < 7.0  # about ln(256) before training
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(Exception, match=r"AUTOPREC_LLAMA_SIZE must be one of tiny, full, but got 'huge'"):
        monkeypatch.setenv("AUTOPREC_LLAMA_SIZE", "huge")
        load_task(LLAMA)


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_llama_builds_on_the_meta_device_for_predict_and_verify_without_training(monkeypatch, size):
    """autoprec predict, verify and export --check build the model under the meta device: the example returns its bare
    model there (it raised "Cannot copy out of meta tensor", after training, before)."""
    from autoprec.tune._measure._task import meta_model

    monkeypatch.setenv("AUTOPREC_LLAMA_SIZE", size)
    model = meta_model(load_task(LLAMA), verb="verify")
    assert all(p.is_meta for p in model.parameters()) and model.lm_head.out_features == 256


@pytest.mark.parametrize("example", sorted(p.parent.name for p in (ROOT / "examples").glob("*/model.py")))
def test_every_example_builds_on_the_meta_device_without_training_or_loading(example, monkeypatch, tmp_path):
    """`autoprec predict examples/tinylm/model.py` (hf_gpt2, hf_bert) failed: build_model trained on the meta device
    ("Cannot copy out of meta tensor"), against docs/model-file.md's meta rule. An empty cache: nothing to load."""
    from autoprec.tune._measure._task import meta_model

    monkeypatch.setenv("AUTOPREC_CACHE", str(tmp_path))
    model = meta_model(load_task(ROOT / "examples" / example / "model.py"), verb="predict")
    assert all(p.is_meta for p in model.parameters()) and list(tmp_path.iterdir()) == []
