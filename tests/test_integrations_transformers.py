"""HF Trainer under a policy: it trains with the model's own forward signature, and the policy's GradScaler
really scales: a step with an inf gradient is skipped, where plain Trainer's weights turn non-finite."""

import warnings

import pytest
import torch

from autoprec import LossScale, Policy

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from autoprec.integrations.transformers import PolicyTrainer  # noqa: E402

POLICY = Policy(
    layers={"": "fp32", "transformer.h.0.mlp.c_fc": "fp16"}, loss_scale=LossScale(init_scale=2.0**8, growth_interval=1000)
)


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def data(n=8):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(0, 64, (16,), generator=g)), "labels": ids} for _ in range(n)]


def arguments(tmp_path, **more):
    settings = dict(max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3, report_to=[], save_strategy="no",
                    logging_strategy="no", use_cpu=True, seed=0)  # fmt: skip
    return transformers.TrainingArguments(output_dir=str(tmp_path), **{**settings, **more})


def inf_at(model, step):
    """An inf in one weight gradient on the `step`-th backward (0-based)."""
    weight, calls = model.transformer.h[1].mlp.c_proj.weight, []

    def hook(grad):
        calls.append(1)
        return grad * float("inf") if len(calls) == step + 1 else grad

    weight.register_hook(hook)


def test_policy_trainer_trains_under_the_policy_and_skips_the_inf_step(tmp_path):
    model = gpt2()
    inf_at(model, 1)
    trainer = PolicyTrainer(policy=POLICY, model=model, args=arguments(tmp_path), train_dataset=data())
    trainer.train()  # a forward that lost input_ids to Trainer's column filter would raise here
    scaler = trainer.autoprec_scaler
    assert scaler.is_enabled() and scaler.skipped_steps == 1 and scaler.get_scale() == 2.0**7  # backed off once
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.transformer.h[0].mlp.c_fc.__dict__.get("forward") is not None  # applied: the wrapped layer


def test_plain_trainer_with_the_same_inf_step_is_the_control_that_breaks(tmp_path):
    model = gpt2()
    inf_at(model, 1)
    transformers.Trainer(model=model, args=arguments(tmp_path), train_dataset=data()).train()
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_under_accelerates_own_fp16_mode_the_gradients_are_unscaled_once(tmp_path, monkeypatch):
    """fp16=True on a GPU turns on accelerate's native AMP, whose clipping unscales (with the scaler it holds, ours):
    PolicyTrainer must not unscale first, or GradScaler refuses a second unscale_. Simulated on the CPU."""
    import accelerate

    monkeypatch.setattr(accelerate.Accelerator, "mixed_precision", property(lambda self: "fp16"))
    model = gpt2()
    trainer = PolicyTrainer(policy=POLICY, model=model, args=arguments(tmp_path), train_dataset=data())
    trainer.accelerator.native_amp = True
    trainer.train()  # a second unscale_ would raise here
    assert trainer.state.global_step == 4 and all(torch.isfinite(p).all() for p in model.parameters())


def test_trainers_own_precision_flags_are_said_to_conflict_with_the_policy(tmp_path):
    unrooted = Policy(layers={"transformer.h.0.mlp.c_fc": "fp16"})  # the layers it does not name run under the flag
    with pytest.warns(UserWarning, match=r"bf16=True\) puts the whole model under bf16 autocast.*the policy says fp32"):
        PolicyTrainer(policy=unrooted, model=gpt2(), args=arguments(tmp_path, bf16=True), train_dataset=data())


def test_trainers_precision_flag_around_a_policy_naming_the_model_is_said_to_change_nothing_inside_it(tmp_path):
    """A searched policy names the model itself (''): its wrapper sets the format inside (fp32: autocast off), so
    bf16=True changes no layer; the warning must not claim the whole model runs in bf16."""
    with pytest.warns(UserWarning) as caught:
        trainer = PolicyTrainer(policy=POLICY, model=gpt2(), args=arguments(tmp_path, bf16=True), train_dataset=data())
    text = " ".join(str(w.message) for w in caught if "TrainingArguments" in str(w.message))
    assert "bf16=True) does not change how the model runs" in text and "names the model itself (fp32)" in text
    assert "whole model" not in text and "everything else runs in bf16" not in text
    seen = {}  # the claim, checked: under Trainer's bf16 autocast every linear still runs as the policy says
    for name in ("transformer.h.1.mlp.c_fc", "lm_head"):
        trainer.model.get_submodule(name).register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
    batch = {k: torch.stack([d[k] for d in data(2)]) for k in ("input_ids", "labels")}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trainer.model(**batch)
    assert seen == {"transformer.h.1.mlp.c_fc": torch.float32, "lm_head": torch.float32}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        PolicyTrainer(policy=Policy(layers={"": "bf16"}), model=gpt2(), args=arguments(tmp_path), train_dataset=data())
        # bf16=True around a policy whose root is bf16 changes nothing: no warning
        PolicyTrainer(policy=Policy(layers={"": "bf16"}), model=gpt2(), args=arguments(tmp_path, bf16=True), train_dataset=data())


def test_scaled_training_matches_unscaled_training_step_for_step(tmp_path):
    """Control: the same policy applied by hand under plain Trainer, no loss scaling. With SGD (Adam would hide a
    wrong gradient scale) and Trainer's default clipping, the weights agree: gradients are unscaled before
    they are clipped and stepped."""
    from autoprec import apply_policy

    scaled = gpt2()
    trainer = PolicyTrainer(
        policy=POLICY, model=scaled, args=arguments(tmp_path / "a", optim="sgd", learning_rate=0.1), train_dataset=data()
    )
    trainer.train()
    control = apply_policy(gpt2(), POLICY)
    transformers.Trainer(
        model=control, args=arguments(tmp_path / "b", optim="sgd", learning_rate=0.1), train_dataset=data()
    ).train()
    assert trainer.autoprec_scaler.skipped_steps == 0
    moved = [(a - gpt2().state_dict()[n]).abs().max().item() for n, a in scaled.state_dict().items() if a.is_floating_point()]
    assert max(moved) > 1e-3  # it trained
    for (name, a), b in zip(scaled.state_dict().items(), control.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_after_each_optimizer_step_the_trainer_does_what_the_policy_needs_there(tmp_path, monkeypatch):
    """Under FSDP2 with the fp8 all-gather, torchao's scale precompute (autoprec.after_optimizer_step), once per
    optimizer step, as the search measured it."""
    import autoprec.integrations.transformers as integration

    calls = []
    monkeypatch.setattr(integration, "after_optimizer_step", calls.append)
    model = gpt2()
    PolicyTrainer(policy=POLICY, model=model, args=arguments(tmp_path), train_dataset=data()).train()
    assert calls == [model] * 4  # max_steps=4


def test_a_schedule_switches_at_its_share_of_max_steps(tmp_path):
    """The fp16 layer raised to bf16 from step 2 of 4: the format the model holds at each optimizer step."""
    from autoprec.apply import applied_summary

    schedule = Policy(layers=POLICY.layers, phases=[{"from_fraction": 0.5, "layers": {"transformer.h.0.mlp.c_fc": "bf16"}}])
    model, seen = gpt2(), []
    model.transformer.h[0].register_forward_pre_hook(
        lambda *_: seen.append(str(applied_summary(model).layers["transformer.h.0.mlp.c_fc"].format))
    )
    PolicyTrainer(policy=schedule, model=model, args=arguments(tmp_path), train_dataset=data()).train()
    assert seen == ["fp16", "fp16", "bf16", "bf16"]
