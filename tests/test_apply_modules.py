"""apply_policy on awkward modules: tied weights, a module used twice, Linear subclasses, MultiheadAttention, RNNs,
norms."""

import copy

import pytest
import torch
from builders import LoRALinear, TaggedLinear, WithLoRA
from torch import nn

from autoprec import Policy, apply_policy
from autoprec.apply import applied_summary
from autoprec.tune._measure._metric import sqnr_db


class TiedLM(nn.Module):
    """An embedding shared with the output head, as in most language models."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.body(self.emb(tokens))))


def _train_steps(model, steps=2, vocab=32):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (4, 8), generator=g)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        opt.step()
    return model


@pytest.mark.parametrize("head", ["bf16", "fp16", "fp32", "fp8"])
def test_tied_weights_stay_tied_and_train_as_one(head):
    model = apply_policy(TiedLM(), Policy(layers={"body": "bf16", "head": head}))
    assert model.head.weight is model.emb.weight  # torchao's Float8Linear keeps the Parameter object
    before = model.emb.weight.detach().clone()
    _train_steps(model)
    assert model.head.weight is model.emb.weight
    assert not torch.equal(model.emb.weight, before)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in TiedLM().named_parameters()]


def test_fp8_that_would_untie_weights_is_refused_naming_both_modules_and_leaves_the_model_as_it_was(monkeypatch):
    from torchao.float8.float8_linear import Float8Linear

    original = Float8Linear.from_float.__func__

    def untying(cls, mod, config=None):  # a torchao that copies the weight instead of keeping the Parameter
        new = original(cls, mod, config=config)
        new.weight = nn.Parameter(mod.weight.detach().clone())
        return new

    monkeypatch.setattr(Float8Linear, "from_float", classmethod(untying))
    model = TiedLM()
    with pytest.raises(ValueError, match=r"untie the weights that 'emb', 'head' share"):
        apply_policy(model, Policy(layers={"head": "fp8"}))
    assert type(model.head) is nn.Linear and model.head.weight is model.emb.weight
    assert applied_summary(model) is None
    apply_policy(model, Policy(layers={"head": "bf16"}))  # the refused model is still fresh


class RecordingLinear(nn.Linear):
    """A Linear that records the autocast dtype its forward runs under (fp32 when autocast is off)."""

    def forward(self, x):
        self.seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32)
        return super().forward(x)


class Shared(nn.Module):
    """One Linear object called at three places (`a`, `b` and `block.0` are the same module)."""

    def __init__(self, linear=nn.Linear):
        super().__init__()
        torch.manual_seed(0)
        self.a = linear(16, 16)
        self.b = self.a
        self.block = nn.Sequential(self.a, nn.ReLU())  # a third name, under another parent

    def forward(self, x):
        return self.b(self.block(self.a(x)))


def test_a_module_used_at_two_places_gets_one_format_and_the_summary_names_its_aliases():
    model = Shared(RecordingLinear)
    model.a.seen = []
    with pytest.warns(UserWarning, match=r"layer 'b' is also used as 'a', 'block\.0'.*bf16 at every place"):
        apply_policy(model, Policy(layers={"b": "bf16"}))  # the second name, which named_modules() dedups
    model(torch.randn(2, 16))
    assert model.a.seen == [torch.bfloat16] * 3
    assert applied_summary(model).aliases() == {"b": ("a", "block.0")}


def test_a_module_used_at_two_places_in_fp8_stays_one_object_everywhere():
    model = Shared()
    with pytest.warns(UserWarning, match=r"layer 'a' / 'block\.0' is also used as 'b'.*fp8") as record:
        apply_policy(model, Policy(layers={"a": "fp8", "block.0": "fp8"}))
    # one alias warning; beside it, where a GPU is present, the hint to move the model there first (the model is on the CPU)
    aliases = [w for w in record if "is also used as" in str(w.message)]
    assert len(aliases) == 1 and aliases[0].filename == __file__  # the user's line, not autoprec's
    assert type(model.a).__name__ == "Float8Linear"
    assert model.a is model.b is model.block[0]
    assert len(list(model.parameters())) == 2
    model(torch.randn(2, 16)).sum().backward()
    assert model.a.weight.grad is not None


def test_two_formats_for_one_module_object_are_refused():
    with pytest.raises(ValueError, match=r"'a' and 'b' are the same module object.*bf16 and fp32"):
        apply_policy(Shared(), Policy(layers={"a": "bf16", "b": "fp32"}))


@pytest.mark.parametrize("fmt", ["fp8", "fp8-rowwise", "fp8-fwd-dgrad"])
def test_a_linear_subclass_with_its_own_forward_and_parameters_is_refused_fp8_and_left_as_it_was(fmt):
    model = WithLoRA()
    x = torch.randn(4, 32)
    before, keys = model(x), list(model.state_dict())
    refusal = (rf"^layer 'lora' cannot be {fmt} here: {fmt} would replace this LoRALinear by torchao's Float8Linear, "
               r"a plain Linear of its weight and bias, dropping its own forward and its parameters lora_a, lora_b; "
               r"give it bf16$")  # fmt: skip
    with pytest.raises(ValueError, match=refusal):
        apply_policy(model, Policy(layers={"plain": fmt, "lora": fmt}))
    assert type(model.lora) is LoRALinear and type(model.plain) is TaggedLinear and applied_summary(model) is None
    assert list(model.state_dict()) == keys and torch.equal(model(x), before)
    apply_policy(model, Policy(layers={"lora": "bf16", "plain": fmt}))  # still fresh; autocast keeps its forward
    assert type(model.lora) is LoRALinear and list(model.state_dict()) == keys
    assert sqnr_db(before, model(x)) > 20  # the adapter still counts: without it, under 5 dB


def test_a_linear_subclass_that_is_a_linear_converts_to_fp8_as_nn_linear_does():
    torch.manual_seed(0)
    plain, tagged = nn.Sequential(nn.Linear(32, 16)), nn.Sequential(TaggedLinear(32, 16))
    tagged.load_state_dict(plain.state_dict())
    for model in (plain, tagged):
        apply_policy(model, Policy(layers={"0": "fp8"}))
    assert type(tagged[0]) is type(plain[0]) and type(tagged[0]).__name__ == "Float8Linear"
    assert list(tagged.state_dict()) == list(plain.state_dict())
    x = torch.randn(4, 32)
    assert torch.equal(tagged(x), plain(x))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_multihead_attention_runs_in_its_format_and_trains(fmt):
    ref, model = Attention(), apply_policy(Attention(), Policy(layers={"attn": fmt}))
    x = torch.randn(2, 5, 32)
    y = model(x)
    y.sum().backward()
    assert y.dtype == torch.float32
    assert 25 < sqnr_db(ref(x), y) < 80  # lowered, and close
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_multihead_attention_out_proj_is_refused_because_it_is_never_called(fmt):
    model = Attention()
    with pytest.raises(ValueError, match=r"'attn\.out_proj' cannot have its own format.*MultiheadAttention 'attn'.*on 'attn'"):
        apply_policy(model, Policy(layers={"attn.out_proj": fmt}))
    assert type(model.attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear


@pytest.mark.parametrize("rnn", [nn.GRU, nn.LSTM])
def test_recurrent_layers_train_in_bf16_and_return_fp32(rnn):
    torch.manual_seed(0)
    ref = nn.Sequential(rnn(16, 32, batch_first=True))
    try:  # torch itself, without autoprec: oneDNN has no bf16 LSTM on CPUs without avx512_bf16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            copy.deepcopy(ref)(torch.randn(2, 5, 16))
    except RuntimeError as exc:
        pytest.skip(f"torch runs no bf16 {rnn.__name__} on this CPU: {str(exc).splitlines()[0][:120]}")
    model = apply_policy(copy.deepcopy(ref), Policy(layers={"0": "bf16"}))
    x = torch.randn(2, 5, 16)
    out, state = model(x)
    assert out.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in (state if isinstance(state, tuple) else (state,)))
    assert sqnr_db(ref(x)[0], out) > 25
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_batchnorm_running_statistics_stay_fp32_under_a_bf16_root():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    model = apply_policy(copy.deepcopy(ref), Policy(layers={"": "bf16"}))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8, generator=g)
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    bn, bn_ref = model[1], ref[1]
    assert bn.running_mean.dtype == bn.running_var.dtype == torch.float32
    assert int(bn.num_batches_tracked) == 3
    assert sqnr_db(bn_ref.running_mean, bn.running_mean) > 30
    assert sqnr_db(bn_ref.running_var, bn.running_var) > 30


def _zero_then_norm():
    """A Linear that outputs exact zeros (in the policy's dtype when lowered), then a LayerNorm."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-1, 1)
    return model


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("listed", ["norm", "root"], ids=["norm listed", "zeros arrive in 16 bits"])
def test_layernorm_with_all_zero_input_gives_its_bias_and_finite_gradients(fmt, listed):
    # A zero variance meets eps in the kernel's fp32 accumulator, even when the zeros arrive in bf16/fp16.
    model = _zero_then_norm()
    apply_policy(model, Policy(layers={"1": fmt} if listed == "norm" else {"": fmt}))
    x = torch.randn(2, 16)
    y = model(x)
    assert y.dtype == torch.float32
    bias = model[1].bias.detach()
    torch.testing.assert_close(y, bias.expand_as(y), rtol=1e-2, atol=1e-2)  # the bias, at most rounded to 16 bits
    y.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
