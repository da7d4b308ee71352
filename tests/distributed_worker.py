"""One rank of tests/test_distributed.py: a policy-applied model trained under DDP or FSDP2 (fully_shard) on the
CPU with gloo; writes what the test checks (its parameters after training, the checkpoint's dtypes) to a file."""

import functools
import os

import torch
import torch.distributed as dist
from torch import nn

from autoprec import Policy, apply_policy, follow_schedule, grad_scaler

POLICY = Policy(layers={"": "bf16", "0": "fp32", "2": "fp16"})
# fsdp2-fp8: FSDP2 all-gathering the fp8 layers' weights in fp8 (torchao's tensorwise recipe, emulated on a CPU)
FP8_POLICY = Policy(layers={"": "bf16", "0": "fp8", "2": "fp8"})


# fsdp2-schedule: a schedule under FSDP2, switching an autocast format in place from the second of three steps while
# an fp8 layer stays fp8 (its Float8Linear, which FSDP2 holds, kept: a review found it swapped again and the step failing)
SCHEDULE = Policy(layers={"": "bf16", "0": "fp32", "2": "fp8"}, phases=[{"from_fraction": 0.5, "layers": {"0": "bf16"}}])
STEPS = 3


def policy_of(wrap):
    return {"fsdp2-fp8": FP8_POLICY, "fsdp2-schedule": SCHEDULE}.get(wrap, POLICY)


def refused_swap():
    """What follow_schedule says where a switch would swap a sharded layer's module for torchao's Float8Linear."""
    from torch.distributed.fsdp import fully_shard

    swap = Policy(layers={"": "bf16", "0": "fp8"}, phases=[{"from_fraction": 0.5, "layers": {"0": "bf16"}}])
    model = apply_policy(build(), swap)
    fully_shard(model)
    try:
        follow_schedule(model, step=2, total_steps=STEPS)
    except ValueError as exc:
        return str(exc)
    return None


BATCH = 16  # fp8 kernels need the weight-gradient matmul's inner dimension (the batch) divisible by 16


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def record_all_gathers():
    """The dtypes torchao hands FSDP2 to all-gather for its fp8 weights, one per all-gather."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    seen, original = [], WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    @functools.wraps(original)  # FSDP2 checks the hook's signature
    def recording(self, *args, **kwargs):
        inputs, metadata = original(self, *args, **kwargs)
        seen.extend(str(t.dtype) for t in inputs)
        return inputs, metadata

    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = recording  # this worker process only
    return seen


def plain(t):
    """A checkpointable tensor: torchao's fp8-all-gather weight wrapper unwrapped to the tensor it holds."""
    return getattr(t, "_tensor", t).detach().clone()


def run(rank, world, wrap, out, port, device="cpu"):
    """`device` "cuda": one GPU per rank, NCCL, and the model moved there before the policy (fp8 kernels)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        policy = policy_of(wrap)
        model = apply_policy(build().to(device), policy, fsdp_fp8_all_gather=wrap == "fsdp2-fp8")
        gathered = record_all_gathers() if wrap == "fsdp2-fp8" else []
        if wrap == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = grad_scaler(policy, device)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        for step in range(STEPS):
            follow_schedule(model, step=step, total_steps=STEPS)  # a no-op but under fsdp2-schedule
            x, y = torch.randn(BATCH, 16, generator=g).to(device), torch.randn(BATCH, 4, generator=g).to(device)
            opt.zero_grad(set_to_none=True)
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
        state = model.module.state_dict() if wrap == "ddp" else {k: plain(v.full_tensor()) for k, v in model.state_dict().items()}
        state = {k: v.cpu() for k, v in state.items()}
        torch.save({"state": state, "dtypes": {k: str(v.dtype) for k, v in state.items()}, "skipped": scaler.skipped_steps,
                    "all_gathered": gathered, "refused": refused_swap() if wrap == "fsdp2-schedule" else None},
                   os.path.join(out, f"rank{rank}.pt"))  # fmt: skip
    finally:
        # every rank done before any tears gloo down: a rank leaving while its peer still talks aborts the peer
        # ("terminate called without an active exception", SIGABRT), about one run in five without this barrier
        dist.barrier()
        dist.destroy_process_group()
