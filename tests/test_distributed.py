"""A policy-applied model under DDP and FSDP2 on the CPU (gloo, two processes): it trains, the ranks agree, the
checkpoint stays fp32, and the weights are what the same training in one process on both ranks' data gives. Under
FSDP2 with fsdp_fp8_all_gather, the fp8 layers' weights are all-gathered in fp8 (torchao's emulation on a CPU)."""

import socket

import distributed_worker as worker
import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed"),
    pytest.mark.slow,  # worker processes, seconds each
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2", "fsdp2-fp8", "fsdp2-schedule"])
def test_a_policy_applied_model_trains_under_data_parallelism_with_ranks_agreeing_and_fp32_checkpoints(tmp_path, wrap):
    mp.spawn(worker.run, args=(2, wrap, str(tmp_path), free_port()), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for name, value in ranks[0]["state"].items():
        torch.testing.assert_close(value, ranks[1]["state"][name], rtol=0, atol=0, msg=name)  # one model, not two
    assert set(ranks[0]["dtypes"].values()) == {"torch.float32"}  # checkpoints stay fp32 under the policy
    before = worker.build().state_dict()
    assert any(not torch.equal(ranks[0]["state"][k], before[k]) for k in before)  # it trained
    assert list(ranks[0]["state"]) == list(before)  # the plain model's keys: loads into it strictly
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == 0
    gathered = ranks[0]["all_gathered"]  # fsdp2-fp8: each fp8 layer's weight, every forward (and backward), in fp8
    assert gathered == [] if wrap != "fsdp2-fp8" else len(gathered) >= 2 * 3 and set(gathered) == {"torch.float8_e4m3fn"}
    if wrap == "fsdp2-schedule":  # its autocast layers switched in place; an fp8 layer's module swap is refused
        assert "switches from fp8 to bf16, and fp8's family (float8) runs a layer by swapping its module" in ranks[0]["refused"]
    control = single_process_control(wrap)
    for name, value in ranks[0]["state"].items():
        torch.testing.assert_close(value, control[name], rtol=1e-3, atol=1e-4, msg=name)


def single_process_control(wrap):
    """The same steps in one process: each rank's batch forward and backward on its own (fp8's tensorwise scales
    are per batch), their gradients averaged, as data parallelism averages them."""
    from torch import nn

    from autoprec import apply_policy, follow_schedule, grad_scaler

    policy = worker.policy_of(wrap)
    model = apply_policy(worker.build(), policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = grad_scaler(policy, "cpu")
    gens = [torch.Generator().manual_seed(100 + rank) for rank in range(2)]
    for step in range(worker.STEPS):
        follow_schedule(model, step=step, total_steps=worker.STEPS)
        opt.zero_grad(set_to_none=True)
        for g in gens:
            x, y = torch.randn(worker.BATCH, 16, generator=g), torch.randn(worker.BATCH, 4, generator=g)
            scaler.scale(nn.functional.mse_loss(model(x), y) / len(gens)).backward()
        scaler.step(opt)
        scaler.update()
    return model.state_dict()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by the GPU suite)")
def test_fsdp2_all_gathers_fp8_weights_on_the_gpu(tmp_path):
    """One rank per GPU with NCCL and fp8 kernels where the GPU has them: the fp8 layers' weights are all-gathered
    in fp8 and training stays finite, with fp32 checkpoints."""
    world = min(torch.cuda.device_count(), 2)
    mp.spawn(worker.run, args=(world, "fsdp2-fp8", str(tmp_path), free_port(), "cuda"), nprocs=world, join=True)
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert set(rank0["all_gathered"]) == {"torch.float8_e4m3fn"} and len(rank0["all_gathered"]) >= 2 * 3
    assert set(rank0["dtypes"].values()) == {"torch.float32"}
    assert all(torch.isfinite(v).all() for v in rank0["state"].values())
