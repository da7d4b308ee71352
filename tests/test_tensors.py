"""map_tensors keeps a model output's own type: the runtime casts lowered layers' outputs back through it."""

import dataclasses
from collections import OrderedDict

import torch
from torch import nn

from autoprec import Policy, apply_policy
from autoprec.tensors import map_tensors


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: tuple
    note: str = "kept"


@dataclasses.dataclass
class DictOutput(OrderedDict):
    """Shaped like Hugging Face's ModelOutput: a dataclass that is also an ordered dict of its set fields."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


class Mapping_(OrderedDict):
    pass


def test_dataclass_and_dict_subclass_outputs_keep_their_type_and_fields():
    half = lambda t: t.half()  # noqa: E731
    out = map_tensors(Output(torch.ones(2), (torch.zeros(1), 3)), half)
    assert type(out) is Output and out.logits.dtype == torch.float16 and out.hidden[0].dtype == torch.float16
    assert out.hidden[1] == 3 and out.note == "kept"
    hf = map_tensors(DictOutput(loss=torch.ones(()), logits=torch.ones(2)), half)
    assert type(hf) is DictOutput and hf.loss.dtype == torch.float16 and hf["logits"].dtype == torch.float16
    od = map_tensors(Mapping_(a=torch.ones(1)), half)
    assert type(od) is Mapping_ and od["a"].dtype == torch.float16


class HFLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, labels=None):
        logits = self.fc(x)
        loss = nn.functional.cross_entropy(logits.float(), labels) if labels is not None else None
        return DictOutput(loss=loss, logits=logits)


def test_a_lowered_root_returns_the_models_own_output_type():
    """With the model itself in bf16 its output is cast back to fp32 for the caller; `.loss` must still work."""
    model = apply_policy(HFLike(), Policy(layers={"": "bf16"}))
    out = model(torch.randn(3, 8), labels=torch.tensor([0, 1, 2]))
    assert type(out) is DictOutput and out.loss.dtype == torch.float32 and out.logits.dtype == torch.float32
    out.loss.backward()


def test_a_rebuilt_dataclass_keeps_fields_set_after_construction_and_runs_no_post_init_again():
    @dataclasses.dataclass
    class WithExtras:
        x: torch.Tensor
        scale: dataclasses.InitVar[float] = 1.0
        aux: object = dataclasses.field(default=None, init=False)

        def __post_init__(self, scale):
            if not isinstance(self.x, torch.Tensor):
                raise TypeError("x must be a tensor")

    obj = WithExtras(torch.ones(2), 2.0)
    obj.aux = "set later"
    out = map_tensors(obj, lambda t: None)  # what the profiler's collecting passes do
    assert type(out) is WithExtras and out.x is None and out.aux == "set later" and obj.x is not None
    same = map_tensors(obj, lambda t: t)  # nothing changed: the very object, shared state kept
    assert same is obj
