"""Buffers the forward pass writes (BatchNorm's running statistics) under every kind of plan.

Two hand-written models with BatchNorm: an image classifier (Conv2d + BatchNorm2d + ReLU
blocks, then a Linear head) and an MLP with BatchNorm1d. One torchrun launch of 4 gloo
processes trains each (model, plan) pair for a few steps (data parallel, data x tensor
parallel, ZeRO-3, a 1F1B pipeline, the plan autoparallel picks) and saves losses, the last
step's gradients and the final state (parameters and buffers, full tensors by FQN); the
tests compare them with one process training the same model with plain PyTorch on the same
global batches, gradient accumulation over the same microbatches. BatchNorm's statistics are
then those of the global (micro)batch, as SyncBatchNorm computes them. The worker also saves
a checkpoint, loads it into a freshly placed model and reports the state it got back.

Layers before a BatchNorm have no bias, as in ResNets: its gradient is zero up to rounding,
which Adam's normalised update would turn into steps of random sign.

Labels are loss targets (``loss_fn(output, labels)``), derived from each input (the argmax of
its first features) so that every batch has a known class per sample.

Run as a script under torchrun, this file is the worker.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, STEPS, LR, SEED, CLASSES = 8, 3, 1e-3, 0, 4


class ConvNet(nn.Module):
    """A small image classifier: conv-BN-ReLU stem, conv-BN-ReLU blocks, linear head."""

    def __init__(self, channels: int = 8, blocks: int = 2, size: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                          nn.BatchNorm2d(channels), nn.ReLU()) for _ in range(blocks))
        self.head = nn.Linear(channels * size * size, CLASSES)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(1))


class MLP(nn.Module):
    """Linear-BatchNorm1d-ReLU blocks and a linear head."""

    def __init__(self, features: int = 16, hidden: int = 32, blocks: int = 2):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(features, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU())
            for _ in range(blocks))
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def labels(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1)[:, :CLASSES].argmax(1)


def loss_fn(output, y):
    """Cross entropy on integer labels (see the module docstring)."""
    return F.cross_entropy(output, y)


MODELS = {"convnet": (ConvNet, (3, 4, 4)), "mlp": (MLP, (16,))}
# case -> (model, plan source, manual_plan options); microbatch_size is per dp rank
CASES = {
    "convnet/dp4": ("convnet", "manual", dict(dp=4, microbatch_size=2)),
    "convnet/dp4-mb2": ("convnet", "manual", dict(dp=4, microbatch_size=1,
                                                   batch_norm="microbatch")),
    "convnet/zero3": ("convnet", "manual", dict(dp=4, microbatch_size=2, zero=3)),
    "convnet/pp2-1f1b": ("convnet", "manual", dict(dp=2, pp=2, microbatch_size=2,
                                                    schedule="1f1b", batch_norm="microbatch")),
    "convnet/auto": ("convnet", "auto", {}),
    "mlp/dp4": ("mlp", "manual", dict(dp=4, microbatch_size=2)),
    "mlp/dp2-tp2": ("mlp", "manual", dict(dp=2, tp=2, microbatch_size=4)),
    "mlp/zero3": ("mlp", "manual", dict(dp=4, microbatch_size=2, zero=3)),
    "mlp/pp2-1f1b": ("mlp", "manual", dict(dp=2, pp=2, microbatch_size=2, schedule="1f1b",
                                           batch_norm="microbatch")),
}
CHECKPOINTED = ("convnet/dp4", "convnet/pp2-1f1b")


def build(model: str) -> nn.Module:
    torch.manual_seed(SEED)
    return MODELS[model][0]()


def batches(model: str) -> list[torch.Tensor]:
    shape = MODELS[model][1]
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randn(BATCH, *shape, generator=gen) * 2 + 0.5 for _ in range(STEPS)]


# -- the worker (torchrun runs this file) ------------------------------------------------------

def worker(out_path: str) -> None:
    import torch.distributed as dist

    checkpoint_dir = str(Path(out_path).parent / "checkpoints")
    dist.init_process_group("gloo")
    results = {case: run_case(case, checkpoint_dir) for case in CASES}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()  # no rank tears gloo down while a peer still works (aborts)
    dist.destroy_process_group()


def run_case(case: str, checkpoint_dir: str) -> dict:
    import torch.distributed as dist

    import meshplan
    from meshplan.mesh import Mesh
    from meshplan.runtime import checkpoint
    from meshplan.graph import CallSignature
    from meshplan.runtime.graph.parallelize import make_optimizer, parallelize_graph

    model_name, source, options = CASES[case]
    data = batches(model_name)
    mesh = Mesh.local(dist.get_world_size())
    if source == "auto":
        plan = meshplan.autoparallel(build(model_name), mesh, (data[0],), loss_fn=loss_fn,
                                     example_targets=(labels(data[0]),), dtype="fp32")
    else:
        plan = meshplan.manual_plan(build(model_name), mesh, (data[0],), loss_fn=loss_fn,
                                    example_targets=(labels(data[0]),), dtype="fp32",
                                    **options)

    def place():
        return parallelize_graph(build(model_name), plan, (data[0], labels(data[0])),
                           loss_fn=loss_fn, signature=CallSignature(1, (), 1))
    pm = place()
    pipeline = plan.num_stages > 1
    opt = make_optimizer(pm.optimizer_params(), plan, lr=LR)
    losses, grads = [], {}
    for step, x in enumerate(data):
        last = step == len(data) - 1
        if pipeline:
            losses.append(pm.forward_backward((x, labels(x))))
            if last:
                grads = pm.full_grads()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            losses.append(pm.train_step((x, labels(x)), opt, grads_out=grads if last else None))
    out = {"losses": losses, "grads": grads, "state": pm.full_state(),
           "microbatches": plan.training.microbatches,
           "plan": f"{plan.num_stages} stage(s), mesh {plan.stages[0].mesh_shape}"}
    if case in CHECKPOINTED:
        directory = str(Path(checkpoint_dir) / case.replace("/", "-"))
        checkpoint.save(directory, pm, opt, STEPS)
        fresh = place()
        fresh_opt = make_optimizer(fresh.optimizer_params(), plan, lr=LR)
        out["loaded_step"] = checkpoint.load(directory, fresh, fresh_opt)
        out["loaded_state"] = fresh.full_state()
    return out


# -- planning: batch norm never normalises a batch shard -----------------------------------

def test_planner_and_manual_plans_run_batch_norm_on_the_whole_batch():
    import meshplan
    from meshplan.mesh import Mesh
    from meshplan.placements import R
    from meshplan.planner.strategies import enumerate_strategies, op_spec
    from meshplan.tracing import trace

    x = batches("mlp")[0]
    graph = trace(build("mlp"), (x,), example_targets=(labels(x),), loss_fn=loss_fn)
    norms = [n for n in graph.nodes if n.target == "aten.batch_norm.default"]
    assert len(norms) == 3
    for node in norms:  # one candidate: every input and the output replicated
        (only,) = enumerate_strategies(op_spec(graph, node), (2, 2))
        assert set(only.output) == {R} and all(set(pl) == {R} for pl in only.inputs)
    plan = meshplan.manual_plan(build("mlp"), Mesh.local(4), graph=graph, dp=2, tp=2,
                                microbatch_size=4, dtype="fp32")
    for node in norms:
        assert all(pl == ("R", "R") for pl in plan.stages[0].ops[node.name].inputs)


# -- the single-process reference -----------------------------------------------------------

def reference(model_name: str, microbatches: int) -> dict:
    """Plain PyTorch on one process: the same batches, the same microbatches (gradient
    accumulation), Adam as the runtime's optimizer."""
    model = build(model_name)
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    losses, grads = [], {}
    for step, x in enumerate(batches(model_name)):
        total = 0.0
        for chunk in x.chunk(microbatches):
            loss = loss_fn(model(chunk), labels(chunk)) / microbatches
            loss.backward()
            total += loss.item()
        losses.append(total)
        if step == STEPS - 1:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "state": dict(model.state_dict())}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from _launch import forked_results

    root = tmp_path_factory.mktemp("buffers")
    return forked_results(__file__, root / "results.pt", nproc=4, timeout=900)


@pytest.mark.parametrize("case", list(CASES))
def test_running_statistics_losses_and_grads_match_one_process(results, case):
    got = results[case]
    ref = reference(CASES[case][0], got["microbatches"])
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=1e-6)
    for name, value in ref["state"].items():  # running_mean / running_var / num_batches_tracked
        assert name in got["state"], f"{case}: {name} missing from full_state()"
        torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{case} {name}: {m}")
    for name, value in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{case} grad {name}: {m}")


def test_buffers_are_in_the_full_state(results):
    state = results["convnet/dp4"]["state"]
    assert {"stem.1.running_mean", "stem.1.running_var", "stem.1.num_batches_tracked",
            "blocks.1.1.running_var"} <= set(state)
    assert int(state["stem.1.num_batches_tracked"]) == STEPS


@pytest.mark.parametrize("case", CHECKPOINTED)
def test_checkpoint_round_trip_restores_buffers(results, case):
    got = results[case]
    assert got["loaded_step"] == STEPS
    assert set(got["loaded_state"]) == set(got["state"])
    for name, value in got["state"].items():
        torch.testing.assert_close(got["loaded_state"][name], value, rtol=0, atol=0,
                                   msg=lambda m, name=name: f"{case} {name}: {m}")


if __name__ == "__main__":
    worker(sys.argv[1])
