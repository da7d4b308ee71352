"""A schedule followed (autoprec/schedule.py: follow_schedule): a policy with phases goes on in its first phase, every
phase checked first, and switches in place as the step counter passes each phase. Each phase is checked against a
fresh model with that phase applied alone (the reference), eager and compiled; the Parameters an optimizer holds and
the modules swapped for fp8 come back as they were."""

import copy

import pytest
import torch
import torch._dynamo
from torch import nn

import autoprec
from autoprec import Policy, apply_policy, follow_schedule
from autoprec.apply import applied_summary


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# fp8 on a Linear (torchao's Float8Linear swapped in), fp16 elsewhere; then raised in two steps
SCHEDULE = Policy(
    layers={"": "bf16", "blocks.0.fc1": "fp8", "blocks.1.fc2": "fp16"},
    phases=[
        {"from_fraction": 0.5, "layers": {"blocks.0.fc1": "bf16"}},
        {"from_fraction": 0.75, "layers": {"blocks.1.fc2": "fp32"}},
    ],
)
X = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def quiet_emulation(recwarn):
    """fp8 runs emulated on a CPU (apply_policy warns so): the warning is not what these tests are about."""


def reference(phase: int) -> nn.Module:
    return apply_policy(Net(), SCHEDULE.in_phase(phase))


def test_each_phase_runs_as_that_phase_applied_alone_and_the_parameters_stay_the_optimizers():
    model = apply_policy(Net(), SCHEDULE)
    params = {name: p for name, p in model.named_parameters()}
    first_fc1 = model.blocks[0].fc1
    assert applied_summary(model).phase == 0 and type(first_fc1).__name__ == "Float8Linear"
    for step, phase in [(0, 0), (3, 0), (4, 1), (5, 1), (6, 2), (7, 2)]:
        switched = follow_schedule(model, step=step, total_steps=8)
        assert switched == (step in (4, 6)), step
        assert applied_summary(model).phase == phase
        torch.testing.assert_close(model(X), reference(phase)(X), rtol=0, atol=0)
    assert {name: p for name, p in model.named_parameters()} == params  # the same Parameter objects throughout
    assert type(model.blocks[0].fc1) is nn.Linear and model.blocks[0].fc1.weight is params["blocks.0.fc1.weight"]
    assert str(applied_summary(model).layers["blocks.1.fc2"].format) == "fp32"
    # back to the start (a run resumed from step 0): the fp8 layer is a Float8Linear again, on the same weight
    assert follow_schedule(model, step=0, total_steps=8)
    assert type(model.blocks[0].fc1).__name__ == "Float8Linear" and model.blocks[0].fc1.weight is params["blocks.0.fc1.weight"]
    torch.testing.assert_close(model(X), reference(0)(X), rtol=0, atol=0)


def test_training_goes_on_across_a_switch_as_one_run_with_a_checkpoint_taken_at_it():
    """Training through the switch in place is the run that trains phase 0, saves a checkpoint at the switch, and
    loads it into a fresh model with phase 1 applied: the optimizer's state and the keys carry over."""
    torch.manual_seed(2)
    batches = [(torch.randn(16, 32), torch.randn(16, 4)) for _ in range(4)]

    def steps(model, opt, chunk):
        for x, y in chunk:
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x).float(), y).backward()
            opt.step()

    scheduled = apply_policy(Net(), SCHEDULE)
    opt = torch.optim.AdamW(scheduled.parameters(), lr=1e-2)
    for i, batch in enumerate(batches):
        follow_schedule(scheduled, step=i, total_steps=5)  # 0.5 of 5: phase 1 from step 3
        steps(scheduled, opt, [batch])
    first = apply_policy(Net(), SCHEDULE.in_phase(0))
    opt0 = torch.optim.AdamW(first.parameters(), lr=1e-2)
    steps(first, opt0, batches[:3])
    second = apply_policy(Net(), SCHEDULE.in_phase(1))
    second.load_state_dict(first.state_dict())
    opt1 = torch.optim.AdamW(second.parameters(), lr=1e-2)
    opt1.load_state_dict(opt0.state_dict())
    steps(second, opt1, batches[3:])
    for (name, a), b in zip(scheduled.state_dict().items(), second.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_compiled_model_recompiles_at_the_switch_and_never_runs_the_old_phases_graph():
    torch._dynamo.reset()
    model = autoprec.compile_model(apply_policy(Net(), SCHEDULE))  # each block compiled in place
    refs = [autoprec.compile_model(reference(p)) for p in range(3)]
    for step, phase in [(0, 0), (4, 1), (6, 2), (0, 0)]:
        follow_schedule(model, step=step, total_steps=8)
        out = model(X)
        out.sum().backward()
        torch.testing.assert_close(out, refs[phase](X), rtol=0, atol=0, msg=f"phase {phase}")


def test_every_phase_is_checked_before_the_model_changes():
    bad = Policy(layers={"": "bf16"}, phases=[{"from_fraction": 0.5, "layers": {"blocks.0": "fp8"}}])  # fp8 on a block
    model = Net()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"^in phase 1 \(from_fraction 0.5\): layer 'blocks.0' cannot be fp8"):
        apply_policy(model, bad)
    assert applied_summary(model) is None and all(not hasattr(m, "_autoprec_format") for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    missing = Policy(layers={"": "bf16"}, phases=[{"from_fraction": 0.5, "layers": {"blocks.9": "fp32"}}])
    with pytest.raises(ValueError, match=r"in phase 1 .*names layers the model lacks: 'blocks.9'"):
        apply_policy(Net(), missing)


def test_a_switch_that_cannot_go_on_leaves_the_model_in_its_phase(monkeypatch):
    model = apply_policy(Net(), SCHEDULE)
    before = model(X)
    real = autoprec.schedule._check_policy

    def refuse(policy, paths, device, kept=frozenset()):
        if policy.layers.get("blocks.0.fc1") is autoprec.Format.BF16:
            raise ValueError("layer 'blocks.0.fc1' cannot be bf16 here: made up")
        real(policy, paths, device, kept)

    monkeypatch.setattr(autoprec.schedule, "_check_policy", refuse)
    with pytest.raises(ValueError, match="made up"):
        follow_schedule(model, step=4, total_steps=8)
    assert applied_summary(model).phase == 0 and type(model.blocks[0].fc1).__name__ == "Float8Linear"
    torch.testing.assert_close(model(X), before, rtol=0, atol=0)


def test_a_copy_switches_on_its_own():
    """The search deep-copies models: a copy's switch puts back its own copies of the swapped-out modules."""
    model = apply_policy(Net(), SCHEDULE)
    twin = copy.deepcopy(model)
    follow_schedule(twin, step=7, total_steps=8)
    assert applied_summary(model).phase == 0 and type(model.blocks[0].fc1).__name__ == "Float8Linear"
    assert applied_summary(twin).phase == 2 and type(twin.blocks[0].fc1) is nn.Linear
    assert twin.blocks[0].fc1.weight is not model.blocks[0].fc1.weight
    assert twin.blocks[0].fc1.weight is dict(twin.named_parameters())["blocks.0.fc1.weight"]


def test_follow_schedule_finds_the_policy_inside_a_wrapper_and_leaves_unscheduled_models_alone():
    holder = nn.Module()
    holder.net = apply_policy(Net(), SCHEDULE)
    holder.other = apply_policy(Net(), Policy(layers={"": "bf16"}))
    assert follow_schedule(holder, step=5, total_steps=8) and applied_summary(holder.net).phase == 1
    assert not follow_schedule(holder.other, step=5, total_steps=8)
    assert not follow_schedule(nn.Linear(2, 2), step=5, total_steps=8)  # no policy at all: nothing to do
    with pytest.raises(ValueError, match="total_steps must be a whole number >= 1"):
        follow_schedule(nn.Linear(2, 2), step=5, total_steps=0)


def test_the_grad_scaler_names_the_format_a_layer_has_now():
    policy = Policy(layers={"blocks.1.fc2": "fp16"}, phases=[{"from_fraction": 0.5, "layers": {"blocks.1.fc2": "fp32"}}])
    model = apply_policy(Net(), policy)
    follow_schedule(model, step=1, total_steps=2)
    model(X).sum().backward()
    model.blocks[1].fc2.weight.grad.fill_(float("inf"))
    assert autoprec.scaler.nonfinite_layers(model, policy) == ["blocks.1.fc2 (fp32)"]
    assert autoprec.grad_scaler(policy, "cpu").is_enabled()  # an fp16 phase: on from the start


def test_a_module_swap_on_parameters_fsdp2_shards_is_refused_before_anything_changes(monkeypatch):
    """FSDP2 keeps each sharded module in its parameter group: a Float8Linear swapped in would train a copy. (The real
    FSDP2 run, two gloo processes, is tests/test_distributed.py's fsdp2-schedule; here a Parameter subclass stands in
    for torch's DTensor.)"""
    model = apply_policy(Net(), SCHEDULE)
    fc1 = model.blocks[0].fc1
    sharded = type("Sharded", (nn.Parameter,), {})
    monkeypatch.setattr(autoprec.schedule, "_dtensor_type", lambda: sharded)
    fc1.weight = sharded(fc1.weight.detach())
    with pytest.raises(
        ValueError,
        match=r"layer 'blocks.0.fc1' switches from fp8 to bf16, and fp8's family \(float8\) runs a layer by swapping its module.*FSDP2",
    ):
        follow_schedule(model, step=4, total_steps=8)
    assert model.blocks[0].fc1 is fc1 and applied_summary(model).phase == 0
    torch.testing.assert_close(model(X), reference(0)(X), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_switch_on_cuda_under_cuda_graphs_runs_the_new_phase_not_a_recorded_graph_of_the_old():
    """On the GPU, fp8 on torchao's kernels (16-divisible shapes), each block compiled with CUDA graphs
    (mode="reduce-overhead", what `autoprec search --cuda-graphs` measures): after the switch the replayed graphs are the
    new phase's. The GPU probe's stage d runs this (benchmarks/gpu_probe.py)."""
    torch._dynamo.reset()
    device = torch.device("cuda")
    x = X.to(device)

    def built(policy):
        return autoprec.compile_model(apply_policy(Net().to(device), policy), mode="reduce-overhead")

    model, refs = built(SCHEDULE), [built(SCHEDULE.in_phase(p)) for p in range(2)]
    outs = {}
    for step in (0, 1, 4, 5):  # two steps a phase: CUDA graphs record on a later call than the first
        follow_schedule(model, step=step, total_steps=8)
        phase = applied_summary(model).phase
        torch.compiler.cudagraph_mark_step_begin()
        outs[step] = (phase, model(x).detach().clone())
    for phase_ref in (0, 1):
        torch.compiler.cudagraph_mark_step_begin()
        expected = refs[phase_ref](x).detach().clone()
        torch.compiler.cudagraph_mark_step_begin()
        expected = refs[phase_ref](x).detach().clone()
        for step, (phase, out) in outs.items():
            if phase == phase_ref:
                torch.testing.assert_close(out, expected, msg=f"step {step}, phase {phase}")
    assert not torch.equal(outs[0][1], outs[5][1])  # the phases differ (fp8 against bf16): the switch is seen


def test_a_model_compiled_whole_switches_through_the_compiled_wrapper():
    """compile_model compiles a model without repeated blocks whole: the OptimizedModule it returns forwards its
    attributes to the model, and must not be taken for a second scheduled model (a review found the switch then
    stripped the model and raised KeyError)."""
    torch._dynamo.reset()
    policy = Policy(
        layers={"": "bf16", "0": "fp16", "2": "fp8"}, phases=[{"from_fraction": 0.5, "layers": {"0": "fp32", "2": "bf16"}}]
    )
    plain = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    compiled = autoprec.compile_model(apply_policy(copy.deepcopy(plain), policy))
    assert compiled is not plain and isinstance(compiled._orig_mod, nn.Sequential)
    refs = [autoprec.compile_model(apply_policy(copy.deepcopy(plain), policy.in_phase(p))) for p in range(2)]
    for step, phase in [(0, 0), (5, 1), (0, 0)]:
        follow_schedule(compiled, step=step, total_steps=10)
        assert applied_summary(compiled._orig_mod).phase == phase
        torch.testing.assert_close(compiled(X), refs[phase](X), rtol=0, atol=0, msg=f"phase {phase}")


def test_a_wrapper_inserted_after_apply_is_refused_before_the_switch_changes_anything():
    """torch's apply_activation_checkpointing wraps each block after apply_policy: the layers are no longer at their
    paths, and a switch by the old names would leave the fp8 module running while the summary said otherwise."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model = apply_policy(Net(), SCHEDULE)
    before = model(X)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    with pytest.raises(ValueError, match=r"layer 'blocks.0.fc1' is no longer at that path .*apply_activation_checkpointing"):
        follow_schedule(model, step=4, total_steps=8)
    assert applied_summary(model).phase == 0
    torch.testing.assert_close(model(X), before, rtol=0, atol=0)


def test_an_fp8_layer_whose_format_does_not_change_keeps_its_module_and_hooks_and_mode_carry_over_a_swap():
    """Only the layers whose format changes are taken off and put back on: an fp8 layer that stays fp8 keeps its
    Float8Linear (what FSDP2 and a compiled block hold); a Linear swapped for Float8Linear keeps its hooks and the
    model's eval mode (a review found the hook silent in the fp8 phase and the mode lost)."""
    policy = Policy(
        layers={"": "bf16", "blocks.0.fc1": "fp8", "blocks.1.fc1": "bf16", "head": "fp16"},
        phases=[{"from_fraction": 0.5, "layers": {"head": "fp32", "blocks.1.fc1": "fp8"}}],
    )
    net = Net()
    calls = []
    handle = net.blocks[1].fc1.register_forward_hook(lambda *_: calls.append(1))
    model = apply_policy(net, policy)
    kept = model.blocks[0].fc1
    model.eval()
    follow_schedule(model, step=1, total_steps=2)
    assert model.blocks[0].fc1 is kept  # unchanged: not swapped again
    swapped = model.blocks[1].fc1
    assert type(swapped).__name__ == "Float8Linear" and not swapped.training  # the model's eval mode
    model(X)
    assert calls == [1]  # the hook registered on the Linear fires in its fp8 phase
    handle.remove()  # and its handle still removes it
    model(X)
    assert calls == [1]
    torch.testing.assert_close(model(X), apply_policy(Net().eval(), policy.in_phase(1))(X), rtol=0, atol=0)
    follow_schedule(model, step=0, total_steps=2)
    assert type(model.blocks[1].fc1) is nn.Linear and not model.blocks[1].fc1.training


def test_a_switch_leaves_a_policy_applied_to_a_module_inside_alone():
    outer = nn.Sequential(nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 32)))
    apply_policy(outer, Policy(layers={"0": "fp16"}, phases=[{"from_fraction": 0.5, "layers": {"0": "bf16"}}]))
    apply_policy(outer[1], Policy(layers={"0": "fp16"}))
    follow_schedule(outer, step=1, total_steps=2)
    assert str(applied_summary(outer[1]).layers["0"].format) == "fp16" and "forward" in outer[1][0].__dict__


def test_a_listed_block_wrapped_at_its_own_path_is_refused_and_the_model_keeps_its_phase():
    """A second review: with the blocks themselves listed, apply_activation_checkpointing puts a wrapper at each block's
    path; the switch stripped the root's format, then raised AttributeError on the wrapper, half-switched."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    policy = Policy(
        layers={"": "bf16", "blocks.0": "fp16", "blocks.1": "bf16"},
        phases=[{"from_fraction": 0.5, "layers": {"blocks.0": "fp32"}}],
    )
    model = apply_policy(Net(), policy)
    before = model(X)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    with pytest.raises(
        ValueError, match=r"layer 'blocks.0' is no longer at that path in the model, or another module stands there"
    ):
        follow_schedule(model, step=1, total_steps=2)
    assert applied_summary(model).phase == 0 and "_autoprec_format" in model.__dict__
    torch.testing.assert_close(model(X), before, rtol=0, atol=0)


def test_full_backward_and_state_dict_hooks_carry_over_an_fp8_swap():
    policy = Policy(
        layers={"": "bf16", "blocks.0.fc1": "bf16"}, phases=[{"from_fraction": 0.5, "layers": {"blocks.0.fc1": "fp8"}}]
    )
    net, fired = Net(), []
    fc1 = net.blocks[0].fc1
    fc1.register_full_backward_hook(lambda *_: fired.append("backward"))
    fc1.register_state_dict_post_hook(lambda *_: fired.append("state_dict"))
    model = apply_policy(net, policy)
    follow_schedule(model, step=1, total_steps=2)
    assert type(model.blocks[0].fc1).__name__ == "Float8Linear"
    model(X).sum().backward()
    model.state_dict()
    assert fired == ["backward", "state_dict"]


def test_a_module_listed_under_another_name_in_the_next_phase_keeps_its_fp8_module():
    """One module, two names (`blocks.0.fc1` and an alias): fp8 under one name, then under the other, is no change."""
    net = Net()
    net.alias = net.blocks[0].fc1  # the same module object at a second path
    policy = Policy(
        layers={"": "bf16", "blocks.0.fc1": "fp8", "head": "fp16"},
        phases=[{"from_fraction": 0.5, "layers": {"alias": "fp8", "head": "fp32"}}],
    )
    model = apply_policy(net, policy)
    fp8 = model.blocks[0].fc1
    follow_schedule(model, step=1, total_steps=2)
    assert model.blocks[0].fc1 is fp8 and model.alias is fp8
