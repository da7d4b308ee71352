"""autoprec/tune/_measure/_layout.py: `autoprec predict --layout FILE` reads the layout a run trains in from
torchtitan's TOML or a launch's arguments (torchtitan's flags, Megatron-LM's, torchrun's), as data (issue 61, 2)."""

from __future__ import annotations

import json
import os

import pytest
from builders import fp8_mlp_task, small_task

from autoprec.errors import UserError
from autoprec.tune._cli import main
from autoprec.tune._measure._layout import read_layout

# torchao's 4xB200 Llama-4-Scout runs, as torchtitan's TOML says them
SCOUT_TOML = """
[job]
description = "Llama 4 debug training"

[training]
local_batch_size = 8
seq_len = 8192

[parallelism]
data_parallel_shard_degree = 4
expert_parallel_degree = 4
tensor_parallel_degree = 1

[activation_checkpoint]
mode = "none"
"""

MEGATRON = """#!/bin/bash
# a Megatron-LM launch: 2 nodes of 8 GPUs
torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py \\
    --tensor-model-parallel-size 2 --expert-model-parallel-size 4 \\
    --micro-batch-size 1 --global-batch-size 64 --seq-length 8192 \\
    --use-distributed-optimizer --recompute-granularity full   # the whole layer recomputed
"""


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_a_torchtitan_toml_gives_its_shards_experts_checkpointing_and_tokens(tmp_path):
    got = read_layout(write(tmp_path, "train.toml", SCOUT_TOML))
    want = {"dp_shard": 4, "dp_replicate": 1, "tp": 1, "ep": 4, "checkpointing": "none", "tokens": 8 * 8192}
    assert got.as_flags() == want and got.fsdp is None  # FSDP2's collectives priced
    accum = SCOUT_TOML.replace("seq_len = 8192", "seq_len = 8192\nglobal_batch_size = 96")  # 8 a rank x 4 ranks x 3
    assert read_layout(write(tmp_path, "accum.toml", accum)).grad_accum == 3
    # HSDP: the optimizer sharded over the shards alone, a micro-step over shards x replicas
    hsdp = accum.replace("tensor_parallel_degree = 1", "data_parallel_replicate_degree = 3")
    got = read_layout(write(tmp_path, "hsdp.toml", hsdp))
    assert (got.dp_shard, got.dp_replicate, got.grad_accum) == (4, 3, 1)
    selective = SCOUT_TOML.replace('mode = "none"', 'mode = "selective"')
    got = read_layout(write(tmp_path, "sac.toml", selective))
    assert got.checkpointing == "none" and "selective checkpointing priced as none" in got.said[0]


def test_what_a_toml_leaves_out_takes_torchtitans_defaults_and_the_shards_are_asked_for(tmp_path):
    got = read_layout(write(tmp_path, "tp.toml", "[parallelism]\ntensor_parallel_degree = 2\n"))
    # torchtitan's defaults: every GPU left as shards (the launch's), 8 sequences of 2048, selective checkpointing
    assert got.as_flags() == {"dp_replicate": 1, "tp": 2, "checkpointing": "none", "tokens": 8 * 2048}
    assert [flag for flag, _ in got.needs] == ["--dp-shard"] and "every GPU the launch gives" in got.needs[0][1]
    assert "(torchtitan's default) selective" in got.said[0]
    batch = read_layout(write(tmp_path, "batch.toml", "[training]\nglobal_batch_size = 64\n"))
    assert [flag for flag, _ in batch.needs] == ["--dp-shard", "--grad-accum"]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (("tensor_parallel_degree = 1", "pipeline_parallel_degree = 4"), "pipeline parallelism over 4 ranks, which predict does not price"),
        (("tensor_parallel_degree = 1", "context_parallel_degree = 2"), "context parallelism over 2 ranks"),
        (("tensor_parallel_degree = 1", 'tensor_parallel_degree = "two"'), "[parallelism] tensor_parallel_degree = 'two' is not a whole number; give one"),
        (("tensor_parallel_degree = 1", 'tensor_parallel_degree = "1_0"'), "'1_0' is not a whole number"),
        (("tensor_parallel_degree = 1", "tensor_parallel_degree = [2]"), "= '[2]' is not a whole number"),
        (("tensor_parallel_degree = 1", "tensor_parallel_degree = 99999999999"), "give a whole number from 1 to 1000000"),
        (("tensor_parallel_degree = 1", "tensor_parallel_degree = " + "9" * 5000), ": not TOML ("),
        (("seq_len = 8192", "seq_len = 8192\nglobal_batch_size = 0"), "global_batch_size = 0; give -1"),
        (('mode = "none"', 'mode = "some"'), "[activation_checkpoint] mode = 'some'; give none, full or selective"),
        (("seq_len = 8192", "seq_len = 8192\nglobal_batch_size = 100"), "a global batch of 100 is no multiple of the 32 sequences"),
        (("[training]", "[training"), ": not TOML"),
        (("[job]", "x = " + "[" * 5000 + "]" * 5000 + "\n[job]"), ": not TOML"),
        (("[training]", "[training]\nbatch_size = 8"), "[training] batch_size is an older torchtitan config's layout key"),
        (("[job]", "[experimental]\npipeline_parallel_degree = 4\n[job]"), "[experimental] pipeline_parallel_degree is an older"),
        (("[training]", "[training]\ndata_parallel_replicate_degree = 2"), "[training] data_parallel_replicate_degree is an older"),
        (("tensor_parallel_degree = 1", "tensor_paralel_degree = 2"), "[parallelism] tensor_paralel_degree is no parallelism degree"),
        (("tensor_parallel_degree = 1", "expert_tensor_parallel_degree = 2"), "expert tensor parallelism over 2 ranks"),
        (("tensor_parallel_degree = 1", "tensor_parallel_degree = 0x" + "f" * 4000), "past any bound; give a whole number from 1"),
        (("expert_parallel_degree = 4", "expert_parallel_degree = 3"), "expert parallelism 3 does not divide the data-parallel shards x tensor-parallel ranks (4 x 1)"),
    ],
)  # fmt: skip
def test_a_toml_predict_cannot_price_or_read_is_refused_in_one_line_naming_the_key(tmp_path, change, said):
    with pytest.raises(UserError) as caught:
        read_layout(write(tmp_path, "bad.toml", SCOUT_TOML.replace(*change)))
    assert said in str(caught.value) and "--layout " in str(caught.value) and "bad.toml" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_layout_section_that_is_no_table_is_refused(tmp_path):
    for text in ("parallelism = 3\n", "[[parallelism]]\ntensor_parallel_degree = 2\n"):
        with pytest.raises(UserError, match=r"\[parallelism\] is not a table of keys"):
            read_layout(write(tmp_path, "odd.toml", text))


def test_a_megatron_launch_gives_the_data_parallel_ranks_from_torchruns_world_size(tmp_path):
    got = read_layout(write(tmp_path, "launch.sh", MEGATRON))
    # 16 GPUs over TP 2: 8 data-parallel ranks, the distributed optimizer sharded over them, 64 / (1 x 8) micro-steps
    want = {"dp_shard": 8, "grad_accum": 8, "tp": 2, "ep": 4, "checkpointing": "full", "tokens": 8192}
    assert got.as_flags() == want
    # Megatron's DDP is not FSDP2: its collectives are said to be left out, not priced as FSDP2's
    assert got.fsdp is False and any("Megatron's data-parallel gradient reduce" in s for s in got.said)
    plain = read_layout(write(tmp_path, "plain.sh", MEGATRON.replace("--use-distributed-optimizer ", "")))
    assert (plain.dp_shard, plain.grad_accum) == (1, 8)
    assert any("every rank updates its whole optimizer" in s for s in plain.said)
    one_node = read_layout(write(tmp_path, "one.sh", MEGATRON.replace(" --nnodes 2", "")))
    assert (one_node.dp_shard, one_node.grad_accum) == (4, 16)  # 8 GPUs
    alone = read_layout(write(tmp_path, "alone.sh", MEGATRON.replace("torchrun --nproc_per_node 8 --nnodes 2 ", "")))
    assert alone.dp_shard is None and [flag for flag, _ in alone.needs] == ["--dp-shard", "--grad-accum"]


@pytest.mark.parametrize(
    ("flags", "checkpointing", "said"),
    [
        ("--recompute-activations", "none", "selective checkpointing priced as none"),
        # Megatron: --recompute-activations sets selective whatever the granularity says, before or after it
        ("--recompute-activations --recompute-granularity full", "none", "selective checkpointing priced as none"),
        ("--recompute-granularity full --recompute-activations", "none", "selective checkpointing priced as none"),
        ("--recompute-granularity full --recompute-method block --recompute-num-layers 2", "full", "partial full recompute"),
    ],
)
def test_megatrons_recompute_flags_are_read_as_megatron_reads_them(tmp_path, flags, checkpointing, said):
    text = MEGATRON.replace("--recompute-granularity full", flags)
    got = read_layout(write(tmp_path, "launch.sh", text))
    assert got.checkpointing == checkpointing and any(said in s for s in got.said), got.said


def test_torchtitans_command_line_flags_are_read_in_either_spelling(tmp_path):
    text = (
        "NGPU=4 ./run_train.sh --parallelism.data_parallel_shard_degree=4 --parallelism.expert-parallel-degree 4 "
        "--training.seq_len=8192 --training.local_batch_size 8 --activation_checkpoint.mode=full --compile.enable\n"
    )
    got = read_layout(write(tmp_path, "run.sh", text))
    assert got.as_flags() == {"dp_shard": 4, "dp_replicate": 1, "ep": 4, "checkpointing": "full", "tokens": 8 * 8192}
    # what its Python config sets is not in the file: the shards are asked for
    shardless = read_layout(write(tmp_path, "tp.sh", "./run_train.sh --parallelism.tensor_parallel_degree=2\n"))
    assert shardless.tp == 2 and [flag for flag, _ in shardless.needs] == ["--dp-shard"]
    # what its Python config sets is said, not guessed
    assert any("activation checkpointing not in the flags" in s for s in shardless.said)
    assert any("the micro-batch not in the flags" in s for s in shardless.said)
    half = read_layout(write(tmp_path, "half.sh", "x --parallelism.data_parallel_shard_degree=2 --training.seq_len=8192\n"))
    assert [flag for flag, _ in half.needs] == ["--tokens"]
    unsized = read_layout(
        write(tmp_path, "g.sh", "x --parallelism.data_parallel_shard_degree=2 --training.global_batch_size=8\n")
    )
    assert [flag for flag, _ in unsized.needs] == ["--grad-accum"]


def test_async_tensor_parallelism_is_read_from_torchtitans_key_or_flag_and_megatrons_overlap_is_said(tmp_path):
    toml = SCOUT_TOML.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 2\nenable_async_tensor_parallel = true")
    assert read_layout(write(tmp_path, "a.toml", toml)).as_flags()["async_tp"] is True
    assert "async_tp" not in read_layout(write(tmp_path, "b.toml", SCOUT_TOML)).as_flags()  # unsaid: predict's default
    flags = "x --parallelism.data_parallel_shard_degree=2 --parallelism.tensor_parallel_degree=2 "
    assert read_layout(write(tmp_path, "on.sh", flags + "--parallelism.enable_async_tensor_parallel\n")).async_tp is True
    off = flags + "--parallelism.no-enable-async-tensor-parallel --compile.enable\n"
    assert read_layout(write(tmp_path, "off.sh", off)).async_tp is False
    assert read_layout(write(tmp_path, "f.sh", flags + "--parallelism.enable_async_tensor_parallel=False\n")).async_tp is False
    with pytest.raises(UserError, match="enable_async_tensor_parallel = 1; give true or false"):
        read_layout(write(tmp_path, "c.toml", toml.replace("= true", "= 1")))
    # torchtitan's CompileConfig holds it since 2026-08 (its #4045): [compile] and --compile.*
    moved = SCOUT_TOML.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 2")
    moved += "\n[compile]\nenable = true\nenable_async_tensor_parallel = true\n"
    assert read_layout(write(tmp_path, "d.toml", moved)).async_tp is True
    assert read_layout(write(tmp_path, "c.sh", flags + "--compile.enable --compile.enable_async_tensor_parallel\n")).async_tp
    alone = read_layout(write(tmp_path, "alone.sh", "x --compile.enable-async-tensor-parallel\n"))
    assert alone.async_tp is True and [flag for flag, _ in alone.needs] == ["--dp-shard"]
    with pytest.raises(UserError, match="no layout flag found"):  # compile's other flags are no layout
        read_layout(write(tmp_path, "nothing.sh", "x --compile.enable\n"))
    megatron = read_layout(write(tmp_path, "m.sh", MEGATRON.replace("--use-distributed-optimizer", "--tp-comm-overlap")))
    assert megatron.async_tp is None and any(s.startswith("--tp-comm-overlap: Transformer Engine's") for s in megatron.said)


def test_torchaos_fp8_all_gather_is_read_from_either_configs_table_or_flag(tmp_path):
    """FSDP's fp8 all-gather: torchtitan's 2025 configs ([quantize.linear.float8]), its older ones ([float8]), and
    the flags; left out where the file does not say (predict's default, off)."""
    assert read_layout(write(tmp_path, "none.toml", SCOUT_TOML)).fp8_all_gather is None
    for table in ("quantize.linear.float8", "float8"):
        on = SCOUT_TOML + f"\n[{table}]\nenable_fsdp_float8_all_gather = true\n"
        assert read_layout(write(tmp_path, "on.toml", on)).as_flags()["fp8_all_gather"] is True
        off = on.replace("= true", "= false")
        assert read_layout(write(tmp_path, "off.toml", off)).fp8_all_gather is False
        with pytest.raises(UserError, match="enable_fsdp_float8_all_gather = 1; give true or false"):
            read_layout(write(tmp_path, "bad.toml", on.replace("= true", "= 1")))
    flags = "x --parallelism.data_parallel_shard_degree=8 "
    assert read_layout(write(tmp_path, "q.sh", flags + "--quantize.linear.float8.enable-fsdp-float8-all-gather\n")).fp8_all_gather
    older = read_layout(write(tmp_path, "o.sh", flags + "--float8.no_enable_fsdp_float8_all_gather\n"))
    assert older.fp8_all_gather is False and older.dp_shard == 8
    # torchtitan's spelling for a few days of 2025-09
    dense = SCOUT_TOML + "\n[quantize.dense.float8]\nenable_fsdp_float8_all_gather = true\n"
    assert read_layout(write(tmp_path, "dense.toml", dense)).fp8_all_gather is True
    # a switch written last on its line takes no value from the next line's command (a review found it refused)
    script = flags + "--quantize.linear.float8.enable_fsdp_float8_all_gather\necho done\n"
    assert read_layout(write(tmp_path, "two.sh", script)).fp8_all_gather is True
    script = flags + "--parallelism.tensor_parallel_degree 2 --compile.enable_async_tensor_parallel\necho done\n"
    assert read_layout(write(tmp_path, "tp.sh", script)).async_tp is True
    # a [quantize] table that is not torchtitan's nesting is not read as the key
    odd = SCOUT_TOML + "\n[quantize]\nlinear = 3\n"
    assert read_layout(write(tmp_path, "odd.toml", odd)).fp8_all_gather is None


def test_predict_reads_fp8_all_gather_and_replicas_from_a_layout_and_a_flag_overrides_them(tmp_path, capsys):
    model = tmp_path / "model.py"
    model.write_text(fp8_mlp_task(), encoding="utf-8")
    toml = write(
        tmp_path,
        "run.toml",
        "[parallelism]\ndata_parallel_shard_degree = 4\ndata_parallel_replicate_degree = 2\n"
        "[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true\n",
    )
    argv = ["predict", str(model), "--target", "h100", "--format", "fp8", "--layout", str(toml), "--json"]
    assert main(argv) == 0
    laid = json.loads(capsys.readouterr().out)["layout"]
    assert (laid["dp_shard"], laid["dp_replicate"], laid["fp8_all_gather"]) == (4, 2, True)
    assert main([*argv, "--no-fp8-all-gather", "--dp-replicate", "1"]) == 0
    laid = json.loads(capsys.readouterr().out)["layout"]
    assert (laid["dp_replicate"], laid["fp8_all_gather"]) == (1, False)
    # a run's config with fp8 all-gather on but no sharding: said, not refused
    alone = write(
        tmp_path, "one.toml", "[parallelism]\ndata_parallel_shard_degree = 1\n[float8]\nenable_fsdp_float8_all_gather = true\n"
    )
    assert main(["predict", str(model), "--target", "h100", "--format", "fp8", "--layout", str(alone), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["layout"]["fp8_all_gather"] is False and any("fp8 all-gather left out" in s for s in result["layout"]["said"])
    # Megatron's data parallelism is not FSDP2's: left out and said, not priced as FSDP2's
    megatron = write(tmp_path, "launch.sh", MEGATRON)
    assert main(["predict", str(model), "--target", "h100", "--format", "bf16", "--layout", str(megatron), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["layout"]["dp_shard"] == 8 and "data_parallel" not in result["parts_ms"]["bf16"]
    assert result["left_out"].startswith("Megatron's data-parallel communication")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("python train.py --lr 3e-4\n", "no layout flag found"),
        # generic names alone (a Hugging Face script's) are not a Megatron launch
        ("torchrun --nproc_per_node 8 train.py --micro_batch_size 2 --global_batch_size 64\n", "no layout flag found"),
        ("x --parallelism.tensor_parallel_degree=2 --tensor-model-parallel-size 2\n", "holds both torchtitan's"),
        ("x --tensor-model-parallel-size\n", "--tensor-model-parallel-size has no value"),
        ("x --parallelism.tensor_parallel_degree\n", "--parallelism.tensor_parallel_degree has no value"),
        ("x --tensor-model-parallel-size $TP\n", "'$TP' is a shell variable; give the expanded command"),
        ("x --micro-batch-size 'one\n", "cannot split it into arguments"),
        ("torchrun --nproc_per_node 3 x --tensor-model-parallel-size 2 --use-distributed-optimizer\n", "3 GPUs"),
        ("x --tensor-model-parallel-size 2 --micro-batch-size 1000000000 --seq-length 1000000000\n", "past 1000000000000"),
        (
            "torchrun --nproc_per_node 1000000 --nnodes 1000000 x --tensor-model-parallel-size 1\n",
            "data-parallel ranks (the world over TP) are past",
        ),
        ("x --tensor-model-parallel-size 2 --recompute-granularity $G\n", "'$G' is a shell variable"),
        (
            'GPT_ARGS="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"\ntorchrun x.py $GPT_ARGS --use-distributed-optimizer\n',
            "the shell variable GPT_ARGS holds layout flags (--pipeline-model-parallel-size)",
        ),
        (
            "x --training.tensor_parallel_degree=2\n",
            "--training.tensor_parallel_degree is an older torchtitan config's layout key",
        ),
        ("x --experimental.pipeline_parallel_degree=2\n", "--experimental.pipeline_parallel_degree is an older"),
    ],
)
def test_a_launch_predict_cannot_read_is_refused_in_one_line(tmp_path, text, said):
    with pytest.raises(UserError) as caught:
        read_layout(write(tmp_path, "launch.sh", text))
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_nothing_in_the_file_is_run_and_a_large_odd_or_missing_file_is_refused(tmp_path):
    marker = tmp_path / "ran"
    text = f"touch {marker}; $(touch {marker}) --tensor-model-parallel-size 2 `touch {marker}`\n"
    assert read_layout(write(tmp_path, "launch.sh", text)).tp == 2 and not marker.exists()
    big = tmp_path / "big.sh"
    big.write_bytes(b"#" * (2 << 20))
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[parallelism]")
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    for path, said in (
        (big, "over 1 MiB"),
        (tmp_path / "no.toml", "cannot read it"),
        (binary, "not UTF-8 text"),
        (fifo, "not a regular file"),
    ):
        with pytest.raises(UserError, match="--layout") as caught:
            read_layout(path)
        assert said in str(caught.value)
    bom = tmp_path / "bom.toml"
    bom.write_bytes("\ufeff[parallelism]\ndata_parallel_shard_degree = 2\n".encode())
    assert read_layout(bom).dp_shard == 2


def run(args, capsys):
    code = main(["predict", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_predict_prices_the_files_layout_as_the_same_flags_and_a_flag_overrides_it(capsys, tmp_path, write_model):
    model = write_model(small_task("def build_model():\n    return nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 4))\n"))
    toml = write(tmp_path, "train.toml", SCOUT_TOML.replace("expert_parallel_degree = 4\n", "").replace('"none"', '"full"'))
    base = [str(model), "--target", "h100", "--format", "fp8", "--json"]
    code, out, err = run([*base, "--layout", str(toml)], capsys)
    assert code == 0, err
    read = json.loads(out)
    flags = ["--dp-shard", "4", "--tp", "1", "--checkpointing", "full", "--tokens", str(8 * 8192)]
    code, out, err = run([*base, *flags], capsys)
    assert code == 0, err
    typed = json.loads(out)
    assert read["layout"].pop("from") == str(toml) and read["layout"]["said"] == []
    assert read == typed
    code, out, err = run([*base, "--layout", str(toml), "--dp-shard", "2"], capsys)
    assert code == 0 and json.loads(out)["layout"]["dp_shard"] == 2, err
    code, out, err = run([*base[:-1], "--layout", str(toml)], capsys)
    assert code == 0 and f"the layout read from {toml} (a flag given overrides it)" in out, err


def test_a_files_async_tensor_parallelism_is_priced_overridden_by_a_flag_and_said_where_there_is_no_tp(
    capsys, tmp_path, write_model
):
    model = write_model(small_task("def build_model():\n    return nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 4))\n"))
    on = "tensor_parallel_degree = 2\nenable_async_tensor_parallel = true"
    toml = write(
        tmp_path, "tp.toml", SCOUT_TOML.replace("expert_parallel_degree = 4\n", "").replace("tensor_parallel_degree = 1", on)
    )
    base = [str(model), "--target", "h100", "--format", "fp8", "--json", "--layout", str(toml)]
    code, out, err = run(base, capsys)
    assert code == 0 and json.loads(out)["layout"]["async_tp"] is True, err
    code, out, err = run([*base, "--no-async-tp"], capsys)
    assert code == 0 and json.loads(out)["layout"]["async_tp"] is False, err
    # a config that turns it on without tensor parallelism: nothing to overlap, said rather than refused
    alone = write(tmp_path, "alone.toml", toml.read_text().replace("tensor_parallel_degree = 2", "tensor_parallel_degree = 1"))
    code, out, err = run([*base[:-1], str(alone)], capsys)
    assert code == 0, err
    laid = json.loads(out)["layout"]
    assert laid["async_tp"] is False and any("asynchronous tensor parallelism left out" in s for s in laid["said"])


def test_predict_asks_for_what_the_file_leaves_to_the_launch_and_refuses_a_flag_that_would_leave_values_stale(
    capsys, tmp_path, write_model
):
    model = write_model(small_task("def build_model():\n    return nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 4))\n"))
    base = [str(model), "--target", "h100", "--format", "fp8", "--json"]
    launch = write(tmp_path, "all.toml", SCOUT_TOML.replace("data_parallel_shard_degree = 4", "data_parallel_shard_degree = -1"))
    code, out, err = run([*base, "--layout", str(launch)], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "every GPU the launch gives; give --dp-shard N" in err
    code, out, err = run([*base, "--layout", str(launch), "--dp-shard", "8"], capsys)
    assert code == 0, err
    result = json.loads(out)
    # the file's expert parallelism has no experts to spread in this dense model: priced without it, and said
    assert result["layout"]["dp_shard"] == 8 and result["layout"]["ep"] == 1
    assert any("no grouped experts" in s for s in result["layout"]["said"])
    code, out, err = run([*base, "--layout", str(launch), "--dp-shard", "8", "--ep", "4"], capsys)
    assert code == 2 and "--ep 4:" in err and "runs no grouped experts" in err, err  # typed, it is a mistake
    megatron = write(tmp_path, "launch.sh", MEGATRON)
    code, out, err = run([*base, "--layout", str(megatron)], capsys)
    assert code == 0 and json.loads(out)["layout"]["grad_accum"] == 8, err
    code, out, err = run([*base, "--layout", str(megatron), "--tp", "4"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--tp 4 beside --layout" in err and "derives its dp-shard (8) from its own tp of 2: edit the file" in err
    code, out, err = run([*base, "--layout", str(megatron), "--tp", "02"], capsys)  # the file's own value: no conflict
    assert code == 0, err
    code, out, err = run([*base, "--layout", str(megatron), "--dp-shard", "4"], capsys)  # its grad-accum came from 8
    assert code == 2 and "--dp-shard 4 beside --layout" in err and "derives its grad-accum (8)" in err, err
    titan = write(tmp_path, "accum.toml", SCOUT_TOML.replace("seq_len = 8192", "seq_len = 8192\nglobal_batch_size = 96"))
    code, out, err = run([*base, "--layout", str(titan), "--dp-shard", "2"], capsys)
    assert code == 2 and "derives its grad-accum (3) from its own dp-shard of 4" in err, err
    alone = write(tmp_path, "alone.sh", MEGATRON.replace("torchrun --nproc_per_node 8 --nnodes 2 ", ""))
    code, out, err = run([*base, "--layout", str(alone), "--dp-shard", "8"], capsys)
    assert code == 2 and "a global batch with no data-parallel ranks to divide it by; give --grad-accum N" in err, err
    code, out, err = run([*base, "--layout", str(alone), "--dp-shard", "8", "--grad-accum", "8"], capsys)
    assert code == 0, err


def test_a_files_expert_parallelism_that_the_models_experts_cannot_share_names_the_file(capsys, tmp_path):
    pytest.importorskip("transformers", minversion="5.0")  # fused experts (torch._grouped_mm) from transformers 5
    from builders import tiny_mixtral

    model = write(tmp_path, "model.py", tiny_mixtral(32, 64, 2, 4, 2))
    toml = write(
        tmp_path,
        "moe.toml",
        SCOUT_TOML.replace("data_parallel_shard_degree = 4", "data_parallel_shard_degree = 3").replace(
            "expert_parallel_degree = 4", "expert_parallel_degree = 3"
        ),
    )
    code, out, err = run([str(model), "--target", "b200", "--format", "bf16", "--layout", str(toml)], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"--ep 3 (from --layout {toml}): " in err and "have 4 experts, which 3 ranks cannot share evenly" in err
