"""Lightning under a policy: the plugin applies it, and its GradScaler really scales: a step with an inf gradient
is skipped where plain Lightning's weights turn non-finite, and clipped SGD steps match unscaled training."""

import pytest
import torch
from torch import nn

from autoprec import LossScale, Policy, apply_policy

L = pytest.importorskip("lightning")
from autoprec.integrations.lightning import PolicyPrecision  # noqa: E402

POLICY = Policy(layers={"": "fp32", "body.0": "fp16"}, loss_scale=LossScale(init_scale=2.0**8, growth_interval=1000))


class Module(L.LightningModule):
    def __init__(self, inf_step=None, lr=1e-2):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.inf_step, self.lr, self.calls = inf_step, lr, 0

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, i):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.calls == self.inf_step:
            self.body[2].weight.register_hook(lambda g: g * float("inf") if self.calls == self.inf_step + 1 else g)
        self.calls += 1
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader():
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, generator=g), torch.randn(4, generator=g)) for _ in range(16)]
    return torch.utils.data.DataLoader(data, batch_size=4)


def fit(module, **trainer):
    settings = dict(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, gradient_clip_val=1.0)  # fmt: skip
    L.Trainer(**{**settings, **trainer}).fit(module, loader())
    return module


def test_the_plugin_applies_the_policy_and_skips_the_inf_step():
    plugin = PolicyPrecision(POLICY, device="cpu")
    module = fit(Module(inf_step=1), plugins=[plugin])
    assert "forward" in module.body[0].__dict__  # applied: the fp16 layer is wrapped
    assert plugin.scaler.is_enabled() and plugin.scaler.skipped_steps == 1 and plugin.scaler.get_scale() == 2.0**7
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_plain_lightning_with_the_same_inf_step_is_the_control_that_breaks():
    module = fit(Module(inf_step=1))
    assert not all(torch.isfinite(p).all() for p in module.parameters())


def test_scaled_training_matches_unscaled_training_with_the_policy_applied_by_hand():
    """Control: the policy applied by hand, no scaler. Clipped SGD agrees: gradients are unscaled before clipping."""
    scaled = fit(Module(lr=0.5), plugins=[PolicyPrecision(POLICY, device="cpu")])
    control = Module(lr=0.5)
    apply_policy(control, POLICY)
    fit(control)
    assert not torch.equal(scaled.body[0].weight, Module().body[0].weight)  # it trained
    for (name, a), b in zip(scaled.state_dict().items(), control.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_the_policy_goes_on_the_named_submodule_and_a_wrong_name_says_what_there_is():
    class Wrapper(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Module().body

        def training_step(self, batch, i):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    policy = Policy(layers={"0": "fp16"})
    wrapper = fit(Wrapper(), plugins=[PolicyPrecision(policy, device="cpu", submodule="net")])
    assert "forward" in wrapper.net[0].__dict__
    with pytest.raises(ValueError, match=r"submodule='body'\): the LightningModule has no such submodule \(its children: net\)"):
        fit(Wrapper(), plugins=[PolicyPrecision(policy, device="cpu", submodule="body")])


def test_fit_then_validate_converts_once_and_keeps_the_scaler():
    """Lightning converts the module on every entry point: the second time finds the policy already on it."""
    plugin = PolicyPrecision(POLICY, device="cpu")
    module = Module(inf_step=1)
    module.validation_step = lambda batch, i=0: nn.functional.mse_loss(module(batch[0]), batch[1])
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[plugin])  # fmt: skip
    trainer.fit(module, loader())
    scaler = plugin.scaler
    trainer.validate(module, loader())
    assert plugin.scaler is scaler and scaler.skipped_steps == 1


def test_after_each_optimizer_step_the_plugin_does_what_the_policy_needs_there(monkeypatch):
    """Under FSDP2 with the fp8 all-gather, torchao's scale precompute (autoprec.after_optimizer_step), on the model
    that holds the policy, once per optimizer step, as the search measured it."""
    import autoprec.integrations.lightning as plugin_module

    calls = []
    monkeypatch.setattr(plugin_module, "after_optimizer_step", calls.append)
    module = fit(Module(), plugins=[PolicyPrecision(POLICY, device="cpu")])
    assert calls == [module] * 4  # max_steps=4


class Formats(L.LightningModule):
    """Records, at each training step, the format the policy's schedule gives body.0 then."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.seen = []

    def training_step(self, batch, i):
        from autoprec.apply import applied_summary

        self.seen.append(str(applied_summary(self).layers["body.0"].format))
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


SCHEDULE = Policy(layers={"": "fp32", "body.0": "fp16"}, phases=[{"from_fraction": 0.5, "layers": {"body.0": "bf16"}}])


@pytest.mark.parametrize(("trainer", "seen"), [
    ({"max_steps": 4}, ["fp16"] * 2 + ["bf16"] * 2),
    # 4 batches an epoch, two epochs, two micro-batches a step: 4 optimizer steps, the switch at the third
    ({"max_steps": -1, "max_epochs": 2, "accumulate_grad_batches": 2}, ["fp16"] * 4 + ["bf16"] * 4),
])  # fmt: skip
def test_a_schedule_switches_at_its_share_of_the_fits_optimizer_steps(trainer, seen):
    module = fit(Formats(), plugins=[PolicyPrecision(SCHEDULE, device="cpu")], **trainer)
    assert module.seen == seen


def test_a_schedule_in_a_fit_of_no_known_length_is_one_error_saying_what_to_give():
    with pytest.raises(
        ValueError,
        match="the policy has phases .* this fit's length is inf optimizer steps; give the Trainer max_steps or max_epochs",
    ):
        fit(Formats(), plugins=[PolicyPrecision(SCHEDULE, device="cpu")], max_steps=-1, max_epochs=-1)
