"""A small decoder that trains sharded: FSDP2's fully_shard on each block, then on the model (as torchtitan shards
its models), for tests/test_ranks.py's searches under torchrun on 2 CPU processes (gloo).

For the tests, by environment variable:
- AUTOPREC_TEST_LOG=<folder>: each rank appends, for every model it shards, the formats its policy gave the Linears
  and the layers whose weights it all-gathers in fp8 (rank<N>.log), so a test can compare what each rank built;
- AUTOPREC_TEST_FAIL=<rank>:<where>: that rank raises in parallelize when the policy lowers any Linear
  (`lowered`: one candidate fails there), in evaluate (`evaluate`: every metric fails there), or in build_model
  (`build`: its model.py checks fail on that rank alone).
"""

import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F

from autoprec.apply import applied_summary

D, VOCAB, SEQ, BATCH = 32, 64, 16, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    if _fails("build"):
        raise RuntimeError("build_model broke on this rank")
    torch.manual_seed(0)
    return Decoder()


def batches(split):
    g = torch.Generator().manual_seed(1 if split == "train" else 2)
    out = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def loss_fn(model, batch):
    ids, targets = batch
    return F.cross_entropy(model(ids).float().reshape(-1, VOCAB), targets.reshape(-1))


def _fails(where):
    rank, _, at = os.environ.get("AUTOPREC_TEST_FAIL", "").partition(":")
    return at == where and dist.is_initialized() and str(dist.get_rank()) == rank


def evaluate(model):
    if _fails("evaluate"):
        raise RuntimeError("evaluate broke on this rank")
    with torch.no_grad():
        return -sum(float(loss_fn(model, b)) for b in batches("eval")) / 2


def parallelize(model, mesh):
    summary = applied_summary(model)  # applied before this call, to the unsharded names
    records = summary.layers.values() if summary is not None else ()
    layers = {rec.name: str(rec.format) for rec in records}
    gathered = sorted(rec.name for rec in records if rec.fsdp_fp8_all_gather)
    folder = os.environ.get("AUTOPREC_TEST_LOG")
    if folder:
        with open(os.path.join(folder, f"rank{dist.get_rank()}.log"), "a") as log:
            log.write(json.dumps({"layers": layers, "fp8_all_gather": gathered}, sort_keys=True) + "\n")
    if _fails("lowered") and any(fmt != "fp32" for fmt in layers.values()):
        raise RuntimeError("this rank cannot shard a lowered Linear")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
