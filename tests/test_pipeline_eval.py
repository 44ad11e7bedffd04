"""Forward-only (eval) calls of pipeline plans on both engines: on 4 gloo processes (one
torchrun launch for every case) each rank's ``run.eval(); run(x)`` equals its rows of one
process's ``model.eval()(x)``, and evaluation leaves training intact: ``run.train()``, a
train step and an SGD step, then eval again, all as in one process."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

import meshplan
from meshplan.specs import parse_model_spec

LLAMA = ("transformers:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=4&"
         "num_attention_heads=4&num_key_value_heads=2&vocab_size=256&max_position_embeddings=64")
TIED = LLAMA + "&tie_word_embeddings=True"
BATCH, SEQ, LR = 8, 16, 0.1


class Mlp(nn.Module):
    """Biased linear blocks; dropout (off in eval) and, optionally, BatchNorm (running
    statistics in eval)."""

    def __init__(self, norm: bool = False, dropout: float = 0.5):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16) if norm else nn.Identity(),
                          nn.Tanh(), nn.Dropout(dropout) if dropout else nn.Identity())
            for _ in range(4))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


# name -> (model, manual_plan options, engine, whether train steps are compared: dropout
# draws differ between one process and a split batch)
CASES = {
    "llama-tied-dp2xpp2-graph": ("tied", dict(dp=2, pp=2), "graph", True),
    "llama-tied-pp2xtp2-graph": ("tied", dict(tp=2, pp=2, schedule="1f1b"), "graph", True),
    "llama-dp2xpp2-modules": ("llama", dict(dp=2, pp=2), "modules", True),
    "llama-pp2xtp2-modules": ("llama", dict(tp=2, pp=2, schedule="1f1b"), "modules", True),
    "llama-dp2xpp2-interleaved-modules": ("llama", dict(dp=2, pp=2, schedule="interleaved-1f1b",
                                                        virtual_stages=2), "modules", True),
    "mlp-dp2xpp2-graph": ("mlp", dict(dp=2, pp=2), "graph", False),
    # the module engine refuses dropout (its masks are drawn per shard): a plain MLP there
    "mlp-plain-dp2xpp2-modules": ("mlp-plain", dict(dp=2, pp=2), "modules", True),
    "mlp-batchnorm-dp2xpp2-graph": ("mlp-bn", dict(dp=2, pp=2, batch_norm="microbatch"),
                                    "graph", False),
}


def build(kind: str, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    if kind.startswith("mlp"):
        with torch.device(device):
            return Mlp(norm=kind == "mlp-bn", dropout=0.0 if kind == "mlp-plain" else 0.5)
    return parse_model_spec(TIED if kind == "tied" else LLAMA).build(device=device)


def data(kind: str):
    g = torch.Generator().manual_seed(1)
    if kind.startswith("mlp"):
        return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    return ids, None


def plan_for(kind: str, options: dict) -> meshplan.Plan:
    model = build(kind, "meta")
    x, y = data(kind)
    meta = dict(example_inputs=(x.to("meta"),))
    if y is not None:
        meta.update(example_targets=(y.to("meta"),), loss_fn=nn.functional.mse_loss)
    return meshplan.manual_plan(model, meshplan.Mesh.local(4), microbatch_size=1, **meta,
                                **options)


def _call(model, kind, x):
    out = model(x)
    return out if kind.startswith("mlp") else out.logits


def reference(kind: str) -> dict:
    """One process: eval outputs, a train step's loss, one SGD step, eval outputs again."""
    from meshplan.tracing import next_token_loss

    model = build(kind)
    x, y = data(kind)
    with torch.no_grad():
        first = _call(model.eval(), kind, x)
    model.train()
    out = _call(model, kind, x)
    loss = nn.functional.mse_loss(out, y) if y is not None else next_token_loss(out, x)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    with torch.no_grad():
        second = _call(model.eval(), kind, x)
    return {"eval": first, "loss": loss.item(), "eval_after_step": second}


def worker(path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for name, (kind, options, engine, train) in CASES.items():
        holder = [plan_for(kind, options) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder)
        plan = holder[0]
        loss_fn = nn.functional.mse_loss if kind.startswith("mlp") else None
        run = meshplan.parallelize(build(kind), plan, loss_fn=loss_fn, engine=engine)
        assert run.engine_name == engine, (name, run.engine_name)
        x, y = data(kind)
        per = BATCH // run.dp_size
        rows = slice(run.dp_rank * per, (run.dp_rank + 1) * per)
        got = {"dp_rank": run.dp_rank, "per": per}
        run.eval()
        got["eval"] = run((x[rows],))
        run.train()
        if train:
            opt = torch.optim.SGD(run.parameters(), lr=LR)
            got["loss"] = run.train_step((x[rows],), targets=() if y is None else (y[rows],))
            opt.step()
            opt.zero_grad()
            run.eval()
            got["eval_after_step"] = run((x[rows],))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, got)
        results[name] = everyone
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, path)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from tests._launch import forked_results

    return forked_results(__file__, tmp_path_factory.mktemp("pipeval") / "out.pt", nproc=4,
                            timeout=600)


@pytest.fixture(scope="module")
def refs():
    return {kind: reference(kind) for kind in {k for k, *_ in CASES.values()}}


@pytest.mark.parametrize("name", list(CASES))
def test_eval_matches_one_process(launched, refs, name):
    kind, _, _, train = CASES[name]
    ref = refs[kind]
    for rank, got in enumerate(launched[name]):
        rows = slice(got["dp_rank"] * got["per"], (got["dp_rank"] + 1) * got["per"])
        torch.testing.assert_close(got["eval"], ref["eval"][rows], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"rank {rank} eval: {m}")
        if train:
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
            torch.testing.assert_close(got["eval_after_step"], ref["eval_after_step"][rows],
                                       rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} eval after a step: {m}")


if __name__ == "__main__":
    worker(sys.argv[1])
