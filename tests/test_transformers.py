"""Real Hugging Face models, built from configs with random weights (no download): a policy keeps their output
types and forward signatures, and the default space finds GPT-2's Conv1D matmuls."""

import inspect

import pytest
import torch

from autoprec import Policy, apply_policy, compile_model
from autoprec.tune._core._space import load_space, space_from_dict

transformers = pytest.importorskip("transformers")


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=64, max_position_embeddings=32, num_labels=3)  # fmt: skip
    return transformers.BertForSequenceClassification(config)


IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "build, policy, batch, output",
    [
        (gpt2, {"": "bf16", "transformer.h.0.attn.c_attn": "fp32", "lm_head": "fp32"}, {"input_ids": IDS, "labels": IDS},
         "CausalLMOutputWithCrossAttentions"),
        (bert, {"": "bf16", "classifier": "fp32"}, {"input_ids": IDS, "labels": torch.tensor([0, 2])}, "SequenceClassifierOutput"),
    ],
)  # fmt: skip
def test_a_lowered_root_keeps_the_models_output_type_and_forward_signature(build, policy, batch, output):
    model = build()
    before = list(inspect.signature(model.forward).parameters)
    apply_policy(model, Policy(layers=policy))
    assert list(inspect.signature(model.forward).parameters) == before  # HF Trainer keeps the columns it names
    assert "input_ids" in before and "labels" in before
    out = model(**batch)
    assert type(out).__name__ == output and out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad and p.dim() > 1)


def test_the_default_space_finds_gpt2s_conv1d_matmuls_and_offers_no_fp8_for_them():
    model = gpt2()
    layers = load_space().tunable_layers(model)
    conv1d = [n for n in layers if n.startswith("transformer.h.")]
    assert conv1d == [
        f"transformer.h.{i}.{p}" for i in range(2) for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    assert {tuple(f.value for f in layers[n]) for n in conv1d} == {("fp32", "bf16", "fp16")}
    assert "lm_head" in layers  # an nn.Linear
    # by import path only: a short name that is not torch.nn's is refused, with the way to name it
    with pytest.raises(ValueError, match=r"unknown module type 'Conv1D'.*transformers.pytorch_utils.Conv1D"):
        space_from_dict({"layers": {"Conv1D": ["fp32", "bf16"]}})


def test_a_policy_on_gpt2s_conv1d_layers_runs_them_in_its_format():
    """Against controls: the Conv1D's own forward in fp32, and under bf16 autocast by hand."""
    model = gpt2()
    apply_policy(model, Policy(layers={"transformer.h.0.mlp.c_fc": "bf16"}))
    layer, x = model.transformer.h[0].mlp.c_fc, torch.randn(2, 4, 32)
    with torch.no_grad():
        fp32 = type(layer).forward(layer, x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = type(layer).forward(layer, x).float()
        got = layer(x)
    assert got.dtype == torch.float32 and torch.equal(got, bf16) and not torch.equal(got, fp32)


def test_a_policy_adds_no_graph_to_compiled_gpt2_blocks():
    """Against the model without a policy: blocks that run one policy share one graph (without the KV cache,
    whose per-layer state makes HF's own code compile a graph per block)."""
    from torch._dynamo.utils import counters

    graphs = {}
    for policy in ({}, {f"transformer.h.{i}.mlp.c_fc": "bf16" for i in range(2)}):
        torch.compiler.reset()
        counters.clear()
        model = apply_policy(gpt2(), Policy(layers=policy))
        compiled = compile_model(model)
        assert compiled is model  # GPT-2's blocks repeat: compiled block by block, in place
        assert torch.isfinite(compiled(input_ids=IDS, labels=IDS, use_cache=False).loss)
        graphs[bool(policy)] = counters["stats"]["unique_graphs"]
    assert graphs[True] == graphs[False] == 1
