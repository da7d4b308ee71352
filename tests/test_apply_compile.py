"""torch.compile after apply_policy: forward and backward run, match eager, and compile once for a fixed shape.

Graph capture and recompiles are decided by dynamo, the same for every backend, so most tests use
backend="aot_eager" (traces forward and backward, no code generation); one test runs inductor for real.
"""

import copy

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from autoprec import Policy, apply_policy
from autoprec.apply import applied_summary
from autoprec.formats import Format, Fp8Backend, has_fp8_kernels
from autoprec.tune._measure._metric import sqnr_db


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.b = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        return self.head(torch.relu(self.b(self.norm(self.a(x)))))


MIXED = Policy(layers={"": "bf16", "a": "fp32", "b": "fp8", "head": "fp16"})


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _steps(model, xs):
    """Training steps; returns each step's output and the grads of the last one."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    outs = []
    for x in xs:
        opt.zero_grad(set_to_none=True)
        out = model(x)
        out.square().mean().backward()
        opt.step()
        outs.append(out.detach())
    return outs, {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 32, generator=g) for _ in range(n)]


def test_compiled_policy_model_matches_eager_without_graph_breaks_or_recompiles():
    eager = apply_policy(Net(), MIXED)
    compiled_model = apply_policy(Net(), MIXED)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)  # fullgraph: a break is an error
    xs = _batches(4)
    outs_c, grads_c = _steps(compiled, xs[:1])
    with torch._dynamo.config.patch(error_on_recompile=True):  # later steps of the same shape reuse the graph
        more, grads_c = _steps(compiled, xs[1:])
    outs_e, grads_e = _steps(eager, xs)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    for oc, oe in zip(outs_c + more, outs_e):
        assert oc.dtype == oe.dtype == torch.float32
        assert sqnr_db(oe, oc) > 40
    for name in grads_e:
        assert sqnr_db(grads_e[name], grads_c[name]) > 30, name


def test_compiled_fp8_layer_keeps_torchao_sqnr_thresholds():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 128))
    low = apply_policy(copy.deepcopy(ref), Policy(layers={"0": "fp8"}))
    compiled = torch.compile(low, backend="aot_eager", fullgraph=True)
    x = torch.randn(32, 64)
    y_ref, y = ref(x), compiled(x)
    y_ref.sum().backward()
    y.sum().backward()
    assert sqnr_db(y_ref, y) >= 20
    assert sqnr_db(ref[0].weight.grad, low[0].weight.grad) >= 17


def test_eval_and_no_grad_passes_compile_once_each():
    model = torch.compile(apply_policy(Net(), MIXED), backend="aot_eager")
    x = torch.randn(8, 32)
    for _ in range(2):
        model.train()
        model(x).sum().backward()
        model.eval()
        with torch.no_grad():
            model(x)
    # One graph for training, one for the no-grad pass; the repeat reuses both.
    assert counters["stats"]["unique_graphs"] == 2


def test_applying_to_a_compiled_model_is_refused_with_the_order_to_use():
    compiled = torch.compile(Net(), backend="aot_eager")
    with pytest.raises(ValueError, match="already compiled; apply the policy to the plain model first, then call torch.compile"):
        apply_policy(compiled, MIXED)


def test_inductor_compiles_a_policy_model_that_trains_like_eager():
    # The one real code-generating compile (tens of seconds on a small CPU): the rest use aot_eager.
    policy = Policy(layers={"": "bf16", "head": "fp32"})
    eager, compiled_model = apply_policy(Net(), policy), apply_policy(Net(), policy)
    compiled = torch.compile(compiled_model)
    xs = _batches(3)
    outs_c, _ = _steps(compiled, xs[:1])
    with torch._dynamo.config.patch(error_on_recompile=True):
        more, grads_c = _steps(compiled, xs[1:])
    outs_e, grads_e = _steps(eager, xs)
    for oc, oe in zip(outs_c + more, outs_e):
        assert sqnr_db(oe, oc) > 30
    for name in grads_e:
        assert sqnr_db(grads_e[name], grads_c[name]) > 25, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inductor_on_cuda_with_fp8_kernels_or_emulation():
    device = torch.device("cuda")
    policy = Policy(layers={"": "bf16", "b": "fp8", "head": "fp32"})
    eager = apply_policy(Net().to(device), policy)
    compiled = torch.compile(apply_policy(Net().to(device), policy))
    xs = [x.to(device) for x in _batches(3)]
    outs_c, grads_c = _steps(compiled, xs)
    outs_e, grads_e = _steps(eager, xs)
    for oc, oe in zip(outs_c, outs_e):
        assert sqnr_db(oe, oc) > 25
    assert counters["stats"]["unique_graphs"] == 1
    expected = Fp8Backend.KERNELS if has_fp8_kernels(device) else Fp8Backend.EMULATION
    assert applied_summary(compiled._orig_mod).fp8_backends() == {"b": expected}


def test_models_with_different_policies_compiled_in_one_process_each_run_their_own_formats():
    """torch.compile keeps one cache per forward code object for every model of a class; its guards must tell
    the policies apart (a format kept as an Enum on the module was not told apart: the second model ran the
    first one's graph)."""
    x = _batches(1)[0]
    # layer k's format is base-3 digit k of i: every combination of fp32/bf16/fp16 over a, b, head in turn
    policies = [
        Policy(layers={n: ("fp32", "bf16", "fp16")[i // 3**k % 3] for k, n in enumerate(("a", "b", "head"))}) for i in range(8)
    ]
    for policy in policies:
        model = apply_policy(Net(), policy)
        expected = model(x)
        assert torch.equal(torch.compile(model, backend="aot_eager")(x), expected), policy.layers
    assert counters["stats"]["unique_graphs"] == len(policies)


def test_repeated_blocks_are_compiled_one_by_one_and_other_models_whole():
    from torch import nn

    from autoprec.apply import compile_model, repeated_blocks

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return x + self.fc(x)

    blocks = nn.ModuleList([Block(), Block(), Block()])
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), *blocks)  # two Linears: siblings, but no children
    assert repeated_blocks(model) == list(blocks)
    assert compile_model(model) is model and all(b._compiled_call_impl is not None for b in blocks)
    flat = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    assert repeated_blocks(flat) == [] and compile_model(flat) is not flat  # whole-model torch.compile


def test_a_compiled_forward_never_constructs_a_format_so_per_layer_policies_stay_one_graph(monkeypatch):
    """Format(name) reads its name with str.__str__, which torch 2.11's dynamo cannot trace: every layer in a format
    other than the root's split the compiled block (6 graphs where 1 on the H200), so searches were biased towards
    uniform policies. The format is resolved once, at apply time; the forward must never construct one (2.13 traces
    the call, so a counted graph alone would not show it here: the construction is made to raise)."""
    model = apply_policy(Net(), MIXED)
    expected = model(_batches(1)[0])

    def constructed(cls, value):
        raise AssertionError(f"Format({value!r}) constructed inside a policy layer's forward")

    monkeypatch.setattr(Format, "__new__", constructed)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=counting)
    x = _batches(1)[0]
    assert torch.equal(model(x), expected)  # eager, the same forward
    out = compiled(x)
    out.square().mean().backward()
    assert len(graphs) == 1
    assert not counters["graph_break"]
    assert sqnr_db(expected, out.detach()) > 40
