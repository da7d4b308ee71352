"""The parallel layout a run trains in, read from the training framework's own configuration (`autoprec predict
--layout FILE`), so a plan prices the layout the run will use rather than one typed again by hand:

- a torchtitan job config (`.toml`, as torchtitan's train_configs were written in 2025): [parallelism]
  data_parallel_shard_degree, data_parallel_replicate_degree, tensor_parallel_degree, expert_parallel_degree,
  pipeline_parallel_degree, context_parallel_degree, enable_async_tensor_parallel (or [compile]'s, where torchtitan
  moved it); [activation_checkpoint] mode; [training] local_batch_size, seq_len, global_batch_size; torchao's
  enable_fsdp_float8_all_gather ([quantize.linear.float8], or an older config's [quantize.dense.float8] or [float8]).
  A key the file leaves out takes torchtitan's default (shards -1: every GPU left, which the launch decides; 8
  sequences of 2048; selective checkpointing). An older config's layout keys (under [training] or [experimental])
  are refused by name.
- a launch's arguments (any other file: a shell script, or a list of arguments), for a torchtitan run configured on
  its command line (--parallelism.tensor_parallel_degree=2 and the other keys above as flags; what its Python config
  sets is not in the file, so the data-parallel ranks must be said) or a Megatron-LM one (--tensor-model-parallel-size,
  --expert-model-parallel-size, --pipeline-model-parallel-size, --context-parallel-size, --micro-batch-size,
  --global-batch-size, --seq-length, --recompute-granularity, --recompute-activations, --recompute-method,
  --use-distributed-optimizer; --tp-comm-overlap, Transformer Engine's own overlap, is said and priced as none, as
  Megatron's data-parallel communication is: predict prices FSDP2's), with
  torchrun's --nproc-per-node and --nnodes for the world size. The flags of every command in the file are read
  together.

The file is read as data: at most MAX_BYTES of a regular file, TOML parsed, arguments split as a shell splits words;
nothing in it is run or imported. What predict cannot price is refused with the key and value that ask for it
(pipeline and context parallelism), and a value the file leaves to the launch is asked for as a flag.
"""

from __future__ import annotations

import dataclasses
import shlex
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from autoprec.errors import UserError, shown
from autoprec.tune._core._numbers import NotANumber, parse_integer

# The most a file predict reads a layout from may hold: a config or a launch script, never a data file
MAX_BYTES = 1 << 20
# The most ranks of any kind (and micro-batches a step) a layout may have, from a file or predict's flags alike
MAX_RANKS = 10**6
# The most sequences, or tokens a sequence, a file may name
MAX_COUNT = 10**9
# The most tokens of one micro-batch (predict's --tokens too): a thousand times the largest published pre-training
# batches (16M tokens)
MAX_TOKENS = 10**12

# torchtitan's defaults for what a TOML leaves out (its JobConfig: Parallelism, Training; ActivationCheckpoint's mode
# is "selective", set below)
_TITAN_SHARD, _TITAN_LOCAL_BATCH, _TITAN_SEQ = -1, 8, 2048
# Megatron-LM's flags only it has: a file naming none of them is not read as a Megatron launch
_MEGATRON_OWN = frozenset(
    (
        "tensor_model_parallel_size",
        "expert_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "use_distributed_optimizer",
        "recompute_granularity",
        "recompute_activations",
    )
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A run's layout as predict prices it; None where the file does not say (predict's default then holds).
    `dp_shard`: the data-parallel ranks the optimizer's state is sharded over; `dp_replicate`: the replicas beside
    them (HSDP); `fp8_all_gather`: torchao's float8 all-gather on; `fsdp`: False where the data parallelism is not
    FSDP2's (Megatron's), whose communication predict does not price; `grad_accum`: micro-batches per
    optimizer step; `tp`, `ep`: tensor- and expert-parallel ranks; `async_tp`: torch's asynchronous tensor
    parallelism on; `checkpointing`: "none" or "full"; `tokens`: one
    rank's micro-batch in tokens; `needs`: each flag that must be given (the file leaves it to the launch) with why;
    `derived`: the values derived from others of the file (a flag that overrides the others would leave them stale);
    `said`: how a value was taken where predict prices it otherwise than the framework runs it."""

    dp_shard: int | None = None
    dp_replicate: int | None = None
    fp8_all_gather: bool | None = None
    fsdp: bool | None = None
    grad_accum: int | None = None
    tp: int | None = None
    ep: int | None = None
    async_tp: bool | None = None
    checkpointing: str | None = None
    tokens: int | None = None
    needs: tuple[tuple[str, str], ...] = ()
    derived: tuple[tuple[str, tuple[str, ...]], ...] = ()
    said: tuple[str, ...] = ()

    def as_flags(self) -> dict[str, Any]:
        """The values the file gives, by predict's flag name."""
        values = {
            "dp_shard": self.dp_shard,
            "dp_replicate": self.dp_replicate,
            "fp8_all_gather": self.fp8_all_gather,
            "grad_accum": self.grad_accum,
            "tp": self.tp,
            "ep": self.ep,
            "async_tp": self.async_tp,
            "checkpointing": self.checkpointing,
            "tokens": self.tokens,
        }
        return {k: v for k, v in values.items() if v is not None}


def read_layout(path: str | Path) -> Layout:
    """The layout in `path`: a torchtitan TOML by its suffix, else a launch's arguments. UserError naming the file, the
    key and the fix for a file predict cannot read or a layout it does not price."""
    path = Path(path)
    where = f"--layout {shown(str(path), 80)}"
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a device or a pipe has no end to read to
            raise UserError(f"{where}: not a regular file; give the run's config or launch script")
        with path.open("rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: a path with a NUL byte
        raise UserError(f"{where}: cannot read it ({getattr(exc, 'strerror', None) or exc}); give a readable file") from None
    if len(data) > MAX_BYTES:
        raise UserError(f"{where}: over 1 MiB; a layout file (a config or a launch script) is smaller")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start}); give the config as text") from None
    return _from_toml(text, where) if path.suffix.lower() == ".toml" else _from_arguments(text, where)


def _whole(value: Any, where: str, key: str, *, least: int = 1, most: int = MAX_RANKS) -> int:
    """A whole number of the file's, from `least` to `most`; UserError naming the key otherwise."""
    _shell_variable(value, where, key)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UserError(f"{where}: {key} = {shown(str(value), 40)} is not a whole number; give one, e.g. 4")
    try:
        number = value if isinstance(value, int) else parse_integer(value)
    except NotANumber:
        raise UserError(f"{where}: {key} = {shown(value, 40)} is not a whole number; give one, e.g. 4") from None
    if not least <= number <= most:
        said = f"= {number}" if number.bit_length() < 64 else "is past any bound"  # str() of a huge int raises
        raise UserError(f"{where}: {key} {said}; give a whole number from {least} to {most}")
    return number


def _shell_variable(value: Any, where: str, key: str) -> None:
    if isinstance(value, str) and "$" in value:
        raise UserError(
            f"{where}: {key} {shown(value, 40)} is a shell variable; give the expanded command (bash -x prints it), "
            "or the value as predict's own flag"
        )


def _unpriced(where: str, what: str, ranks: int, why: str) -> UserError:
    return UserError(
        f"{where}: {what} over {ranks} ranks, which predict does not price ({why}); leave --layout out and give the "
        "nearest layout it prices with --dp-shard, --tp, --ep and --tokens"
    )


@dataclasses.dataclass
class _Read:
    """The layout keys of one file, whatever their spelling: filled by a reader, then turned into a Layout."""

    where: str
    shard: int | None = None  # torchtitan's data_parallel_shard_degree (-1: every GPU left)
    replicate: int = 1
    tp: int | None = None
    ep: int | None = None
    async_tp: bool | None = None
    fp8_all_gather: bool | None = None
    pp: int = 1
    cp: int = 1
    local_batch: int | None = None
    seq: int | None = None
    global_batch: int | None = None
    checkpointing: str | None = None
    world: int | None = None  # torchrun's
    distributed_optimizer: bool | None = None  # Megatron's: None where the framework is torchtitan (FSDP)
    said: list[str] = dataclasses.field(default_factory=list)

    def layout(self) -> Layout:
        if self.pp > 1:
            raise _unpriced(self.where, "pipeline parallelism", self.pp, "its stages and bubbles")
        if self.cp > 1:
            raise _unpriced(self.where, "context parallelism", self.cp, "its ring attention")
        tp = self.tp or 1
        needs: list[tuple[str, str]] = []
        derived: list[tuple[str, tuple[str, ...]]] = []
        data = None  # the data-parallel ranks, where the file says
        dp_shard: int | None = None
        if self.distributed_optimizer is None:  # torchtitan: FSDP shards the optimizer over the shard degree
            if self.shard is not None and self.shard > 0:
                data, dp_shard = self.shard * self.replicate, self.shard
                if self.ep and (self.shard * tp) % self.ep:  # torchtitan's own rule: EP borrows shard and TP ranks
                    raise UserError(
                        f"{self.where}: expert parallelism {self.ep} does not divide the data-parallel shards x "
                        f"tensor-parallel ranks ({self.shard} x {tp}), which torchtitan refuses too; give a divisor"
                    )
            else:
                why = (
                    "data_parallel_shard_degree -1 takes every GPU the launch gives"
                    if self.shard == -1
                    else ("the file does not say the data-parallel shards (its Python config or launch does)")
                )
                needs.append(("--dp-shard", why))
        else:  # Megatron: the ranks left by TP, PP and CP are data-parallel; the optimizer shards only when asked
            self.said.append("Megatron's data-parallel gradient reduce and parameter gather not priced (predict prices FSDP2's)")
            if self.world is not None:
                if self.world % (tp * self.pp * self.cp):
                    raise UserError(
                        f"{self.where}: {self.world} GPUs (torchrun's --nproc-per-node x --nnodes) are no multiple of "
                        f"--tensor-model-parallel-size {tp}; give a world size it divides"
                    )
                data = self.world // (tp * self.pp * self.cp)
                if data > MAX_RANKS:
                    raise UserError(f"{self.where}: {data} data-parallel ranks (the world over TP) are past {MAX_RANKS}")
                if self.distributed_optimizer:
                    derived.append(("dp_shard", ("--tp",)))
            if not self.distributed_optimizer:
                dp_shard = 1
                self.said.append("no --use-distributed-optimizer: every rank updates its whole optimizer")
            elif data is None:
                needs.append(("--dp-shard", "--use-distributed-optimizer with no torchrun world size in the file"))
            else:
                dp_shard = data
        accum = None
        if self.global_batch is not None and self.global_batch != -1 and self.local_batch:
            if data is None:
                needs.append(("--grad-accum", "a global batch with no data-parallel ranks to divide it by"))
            else:
                per_step = self.local_batch * data
                if self.global_batch % per_step:
                    raise UserError(
                        f"{self.where}: a global batch of {self.global_batch} is no multiple of the {per_step} sequences "
                        f"a micro-step takes ({self.local_batch} a rank x {data} data-parallel ranks); give one that is"
                    )
                accum = self.global_batch // per_step
                if accum > MAX_RANKS:
                    raise UserError(
                        f"{self.where}: {accum} micro-batches a step (the global batch over a micro-step's) are past {MAX_RANKS}"
                    )
                # Megatron's ranks come from TP (and, with its distributed optimizer, are the shards); torchtitan's
                # are the file's shards and replicas
                sources = (
                    ("--dp-shard", "--dp-replicate")
                    if self.distributed_optimizer is None
                    else (("--tp", "--dp-shard") if self.distributed_optimizer else ("--tp",))
                )
                derived.append(("grad_accum", sources))
        elif self.global_batch is not None and self.global_batch != -1:
            needs.append(("--grad-accum", "a global batch with no micro-batch size beside it"))
        if bool(self.local_batch) != bool(self.seq):
            needs.append(("--tokens", "a micro-batch's sequences or their length, not both"))
        tokens = self.local_batch * self.seq if self.local_batch and self.seq else None
        if tokens is not None and tokens > MAX_TOKENS:
            raise UserError(f"{self.where}: {self.local_batch} sequences of {self.seq} tokens are past {MAX_TOKENS} a rank")
        titan = self.distributed_optimizer is None
        return Layout(
            dp_shard=dp_shard,
            dp_replicate=self.replicate if titan else None,
            fp8_all_gather=self.fp8_all_gather,
            fsdp=None if titan else False,
            grad_accum=accum,
            tp=self.tp,
            ep=self.ep,
            async_tp=self.async_tp,
            checkpointing=self.checkpointing,
            tokens=tokens,
            needs=tuple(needs),
            derived=tuple(derived),
            said=tuple(self.said),
        )


_YES, _NO = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _switch(value: Any, where: str, key: str) -> bool:
    """A yes-or-no key: a TOML boolean, or a flag's word (a flag with no word after it is on)."""
    _shell_variable(value, where, key)
    if isinstance(value, bool):
        return value
    word = "true" if value is None else (value.strip().lower() if isinstance(value, str) else "")
    if word in _YES:
        return True
    if word in _NO:
        return False
    said = shown(value, 40) if isinstance(value, str) else str(value)[:40]  # a TOML number as the file writes it
    raise UserError(f"{where}: {key} = {said}; give true or false")


def _checkpointing(read: _Read, key: str, mode: Any) -> str:
    _shell_variable(mode, read.where, key)
    value = str(mode).strip().lower()
    if value in ("none", "full"):
        return value
    if value in ("selective", "op", "layer"):
        read.said.append(f"{key} {value}: selective checkpointing priced as none")
        return "none"
    raise UserError(f"{read.where}: {key} = {shown(str(mode), 40)}; give none, full or selective")


# ---- torchtitan's TOML -------------------------------------------------------------------------------------------


def _from_toml(text: str, where: str) -> Layout:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the tomli the package depends on there
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        config = tomllib.loads(text)
    except (ValueError, RecursionError) as exc:  # TOMLDecodeError is a ValueError; so is an integer past int's digits
        raise UserError(
            f"{where}: not TOML ({str(exc)[:120]}); give a torchtitan .toml, or the launch's arguments in a file of "
            "another suffix"
        ) from None
    _check_sections(config, where)
    read = _Read(where, shard=_TITAN_SHARD, local_batch=_TITAN_LOCAL_BATCH, seq=_TITAN_SEQ)
    for section, key, value in _titan_items(config):
        _titan_key(read, f"[{section}] {key}", section, key, value)
    if read.checkpointing is None:
        read.checkpointing = _checkpointing(read, "[activation_checkpoint] mode (torchtitan's default)", "selective")
    return read.layout()


# the [parallelism] keys predict reads; any other *_degree there is a layout it would silently leave out
_PARALLELISM = frozenset(
    (
        "data_parallel_shard_degree",
        "data_parallel_replicate_degree",
        "tensor_parallel_degree",
        "expert_parallel_degree",
        "pipeline_parallel_degree",
        "context_parallel_degree",
        "expert_tensor_parallel_degree",
    )
)


def _refuse_unread(section: str, key: str, where: str, key_shown: str) -> None:
    """A layout key predict would otherwise read as nothing: an older torchtitan config's ([training]
    data_parallel_degree and batch_size, [experimental] pipeline_parallel_degree), or a [parallelism] degree it does not
    know. Refused by name."""
    older = section in ("training", "experimental") and (key.endswith("_degree") or key == "batch_size")
    if older:
        raise UserError(
            f"{where}: {key_shown} is an older torchtitan config's layout key; predict reads [parallelism] and "
            "[training] local_batch_size (torchtitan's 2025 configs): give the layout with --dp-shard, --tp, --ep and "
            "--tokens instead"
        )
    if section == "parallelism" and key.endswith("_degree") and key not in _PARALLELISM:
        raise UserError(
            f"{where}: {key_shown} is no parallelism degree predict knows ({', '.join(sorted(_PARALLELISM))}); "
            "correct it, or leave --layout out and give the flags"
        )


def _check_sections(config: Mapping[str, Any], where: str) -> None:
    """Each layout section a table, and no key in it that predict would read as nothing (_refuse_unread)."""
    for section in ("parallelism", "training", "activation_checkpoint", "experimental", "compile"):
        table = config.get(section)
        if section in config and not isinstance(table, Mapping):
            raise UserError(f"{where}: [{section}] is not a table of keys; write it as torchtitan's configs do")
        for key in table or ():
            _refuse_unread(section, key, where, f"[{section}] {key}")


def _titan_items(config: Mapping[str, Any]):  # type: ignore[no-untyped-def]
    for section in ("parallelism", "training", "activation_checkpoint", "compile"):
        table = config.get(section)
        if isinstance(table, Mapping):
            for key, value in table.items():
                yield section, key, value
    for section, key in sorted(_FP8_GATHER):  # nested tables: [quantize.linear.float8]
        *path, last = [section, *key.split(".")]
        table = config
        for name in path:
            table = table.get(name) if isinstance(table, Mapping) else None
        if isinstance(table, Mapping) and last in table:
            yield section, key, table[last]


# torchtitan's yes-or-no keys predict reads (as a flag: on alone, or its no_ spelling off): async TP's, under
# [parallelism] in its 2025 configs and under [compile] since its 2026-08 CompileConfig (torchtitan #4045)
_SWITCHES = frozenset(("enable_async_tensor_parallel", "no_enable_async_tensor_parallel"))
_SWITCH_SECTIONS = ("parallelism", "compile")
# torchao's float8 all-gather under FSDP, where torchtitan's 2025 configs put it ([quantize.linear.float8]; for a few
# days of 2025-09, [quantize.dense.float8]) and where its older ones did ([float8]): (section, the key under it)
_FP8_GATHER = frozenset(
    (section, prefix + word)
    for section, prefix in (("quantize", "linear.float8."), ("quantize", "dense.float8."), ("float8", ""))
    for word in ("enable_fsdp_float8_all_gather", "no_enable_fsdp_float8_all_gather")
)


def _titan_key(read: _Read, key_shown: str, section: str, key: str, value: Any) -> None:
    """One torchtitan key (a TOML entry or a --section.key flag) into `read`; others are not the layout's."""
    switch = _is_switch(section, key)  # a flag of its own is on
    if value is None and not switch:
        raise UserError(f"{read.where}: {key_shown} has no value; give it one")
    if switch:
        on = _switch(value, read.where, key_shown)
        on = on if key.rsplit(".", 1)[-1].startswith("enable") else not on
        if (section, key) in _FP8_GATHER:
            read.fp8_all_gather = on
        else:
            read.async_tp = on
    elif section == "parallelism":
        if key == "data_parallel_shard_degree":
            read.shard = _whole(value, read.where, key_shown, least=-1)
            if read.shard == 0:
                raise UserError(f"{read.where}: {key_shown} = 0; give -1 (every GPU left) or a count of GPUs")
        elif key == "data_parallel_replicate_degree":
            read.replicate = _whole(value, read.where, key_shown)
        elif key == "tensor_parallel_degree":
            read.tp = _whole(value, read.where, key_shown)
        elif key == "expert_parallel_degree":
            read.ep = _whole(value, read.where, key_shown)
        elif key == "pipeline_parallel_degree":
            read.pp = _whole(value, read.where, key_shown)
        elif key == "context_parallel_degree":
            read.cp = _whole(value, read.where, key_shown)
        elif key == "expert_tensor_parallel_degree" and _whole(value, read.where, key_shown) != 1:
            raise _unpriced(read.where, "expert tensor parallelism", int(value), "the experts' own TP collectives")
    elif section == "training":
        if key == "local_batch_size":
            read.local_batch = _whole(value, read.where, key_shown, most=MAX_COUNT)
        elif key == "seq_len":
            read.seq = _whole(value, read.where, key_shown, most=MAX_COUNT)
        elif key == "global_batch_size":
            read.global_batch = _whole(value, read.where, key_shown, least=-1, most=MAX_COUNT)
            if read.global_batch == 0:
                raise UserError(f"{read.where}: {key_shown} = 0; give -1 (a micro-batch on every rank) or a count")
    elif section == "activation_checkpoint" and key == "mode":
        read.checkpointing = _checkpointing(read, key_shown, value)


# ---- a launch's arguments (torchtitan's flags, Megatron-LM's, torchrun's) ------------------------------------------


def _from_arguments(text: str, where: str) -> Layout:
    try:
        words = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise UserError(f"{where}: cannot split it into arguments as a shell would ({exc}); close its quotes") from None
    flags: dict[str, str | None] = {}
    for i, word in enumerate(words):
        _refuse_hidden_flags(word, where)
        if not word.startswith("--"):
            continue
        key, eq, given = word[2:].partition("=")
        value: str | None = given
        name = key.replace("-", "_")
        if not eq:  # --key value, or a switch (--use-distributed-optimizer) followed by the next flag
            following = words[i + 1] if i + 1 < len(words) else None
            value = following if following is not None and not following.startswith("--") else None
            section, _, rest = name.partition(".")
            if value is not None and _is_switch(section, rest) and value.strip().lower() not in (*_YES, *_NO):
                value = None  # a switch alone, the next word another command's (the file's lines are read as one)
        flags[name] = value  # torchrun and Megatron spell words with - or _, tyro's flags too
    read = _Read(where)
    megatron = {k for k in flags if k in _MEGATRON} if _MEGATRON_OWN & set(flags) else set()
    sections = ("parallelism", "training", "activation_checkpoint", "experimental")
    titan = {k for k in flags if "." in k and k.split(".", 1)[0] in sections}
    titan |= {k for k in flags if k.startswith("compile.") and k.split(".", 1)[1] in _SWITCHES}
    titan |= {k for k in flags if tuple(k.split(".", 1)) in _FP8_GATHER}
    for key in titan:
        section, name = key.split(".", 1)
        _refuse_unread(section, name, where, f"--{key}")
    if megatron and titan:
        raise UserError(
            f"{where}: holds both torchtitan's (--{sorted(titan)[0]}) and Megatron-LM's "
            f"(--{sorted(megatron)[0].replace('_', '-')}) layout flags; give one run's"
        )
    if not megatron and not titan:
        raise UserError(
            f"{where}: no layout flag found (torchtitan's --parallelism.*, --training.*, --activation_checkpoint.mode, "
            "or Megatron-LM's --tensor-model-parallel-size and the rest); give a torchtitan .toml or the launch's "
            "arguments"
        )
    for key in sorted(titan):
        section, name = key.split(".", 1)
        _titan_key(read, f"--{key}", section, name, flags[key])
    if titan:  # what torchtitan's Python config sets is not in the file
        if read.checkpointing is None:
            read.said.append("activation checkpointing not in the flags (torchtitan's config sets it): priced as none")
        if read.local_batch is None and read.seq is None:
            read.said.append("the micro-batch not in the flags (torchtitan's config sets it): model.py's batch")
    if megatron:
        read.distributed_optimizer = "use_distributed_optimizer" in flags
        for key in sorted(megatron):
            _MEGATRON[key](read, f"--{key.replace('_', '-')}", flags[key])
        if "recompute_activations" in flags:  # Megatron: selective, whatever --recompute-granularity says
            read.said = [s for s in read.said if "recompute" not in s]
            read.checkpointing = _checkpointing(read, "--recompute-activations", "selective")
        elif read.checkpointing == "full" and ("recompute_method" in flags or "recompute_num_layers" in flags):
            read.said.append("--recompute-method/--recompute-num-layers: a partial full recompute priced as full")
        nodes, per_node = flags.get("nnodes"), flags.get("nproc_per_node")
        if per_node is not None:
            read.world = _whole(per_node, where, "--nproc-per-node") * (
                _whole(nodes, where, "--nnodes") if nodes is not None else 1
            )
    return read.layout()


def _is_switch(section: str, key: str) -> bool:
    """Whether a torchtitan key (under `section`; a flag's words with - read as _) is one of its yes-or-no keys predict
    reads."""
    return (section in _SWITCH_SECTIONS and key in _SWITCHES) or (section, key) in _FP8_GATHER


def _refuse_hidden_flags(word: str, where: str) -> None:
    """A shell variable assigned layout flags (GPT_ARGS="--tensor-model-parallel-size 2 ...", then $GPT_ARGS on the
    command line: older Megatron examples): its flags would be read as nothing, so it is refused."""
    name, eq, value = word.partition("=")
    if not eq or not name.isidentifier() or "--" not in value:
        return
    inner = {w[2:].partition("=")[0].replace("-", "_") for w in value.split() if w.startswith("--")}
    hidden = sorted(k for k in inner if k in _MEGATRON or k.split(".", 1)[0] in ("parallelism", "training"))
    if hidden:
        raise UserError(
            f"{where}: the shell variable {name} holds layout flags (--{hidden[0].replace('_', '-')}), which predict "
            "does not expand; give the expanded command (bash -x prints it)"
        )


def _set(field: str, most: int = MAX_RANKS) -> Callable[[_Read, str, str | None], None]:
    def take(read: _Read, key: str, value: str | None) -> None:
        if value is None:
            raise UserError(f"{read.where}: {key} has no value; give it one")
        setattr(read, field, _whole(value, read.where, key, most=most))

    return take


def _granularity(read: _Read, key: str, value: str | None) -> None:
    read.checkpointing = _checkpointing(read, key, value if value is not None else "")


_MEGATRON: dict[str, Callable[[_Read, str, str | None], None]] = {
    "tensor_model_parallel_size": _set("tp"),
    "expert_model_parallel_size": _set("ep"),
    "pipeline_model_parallel_size": _set("pp"),
    "context_parallel_size": _set("cp"),
    "micro_batch_size": _set("local_batch", MAX_COUNT),
    "global_batch_size": _set("global_batch", MAX_COUNT),
    "seq_length": _set("seq", MAX_COUNT),
    "recompute_granularity": _granularity,
    "recompute_activations": lambda read, key, value: None,  # read after the others: it decides
    # Transformer Engine's userbuffer overlap of TP's collectives: not torch's asynchronous TP, which is all predict prices
    "tp_comm_overlap": lambda read, key, value: read.said.append(
        f"{key}: Transformer Engine's overlap of the tensor-parallel collectives priced as none (--async-tp prices torch's)"
    ),
    "use_distributed_optimizer": lambda read, key, value: None,  # read above
}
