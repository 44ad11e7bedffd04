"""Local-shard optimizers (runtime/graph/optim.py) step exactly like stock torch.optim.

One torchrun launch of 2 gloo processes for the module (this file is the worker): every
case builds the same DTensor parameters twice, steps stock Adam/SGD on one set and the
local-shard class on the other with the same gradients for 3 steps, and saves the full
parameters and states of both, their layouts, and which path (local shards or DTensor)
each call of the functional update took. Shard(0) and Shard(1) with uneven shards catch a
shard mix-up that a 1-process mesh would hide. The rest runs in the test process.
"""

from __future__ import annotations

import sys

import pytest
import torch

from meshplan.errors import NotSupportedError
from meshplan.runtime.graph.optim import LocalShardAdam, LocalShardSGD

STEPS = 3
SHAPES = [(5, 3), (4, 6), (7,)]  # uneven over 2 ranks on dim 0 (5, 7) and dim 1 (3); S1 of
# the 1-D one is S0

OPTIMIZERS = {  # name -> (stock class, local-shard class, keyword arguments)
    "adam": (torch.optim.Adam, LocalShardAdam, dict(lr=1e-2, foreach=False)),
    "adam-amsgrad-wd-max": (torch.optim.Adam, LocalShardAdam,
                            dict(lr=1e-2, amsgrad=True, weight_decay=0.1, maximize=True)),
    "adamw": (torch.optim.Adam, LocalShardAdam,
              dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    "sgd-momentum": (torch.optim.SGD, LocalShardSGD, dict(lr=1e-2, momentum=0.9)),
    "sgd-nesterov-wd": (torch.optim.SGD, LocalShardSGD,
                        dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "sgd-plain": (torch.optim.SGD, LocalShardSGD, dict(lr=1e-2)),
}
LAYOUTS = {  # name -> (parameter placement, gradient placement; None: a plain tensor)
    "shard0": ("S0", "S0"),
    "shard1": ("S1", "S1"),
    "replicate": ("R", "R"),
    "grad-replicate": ("S0", "R"),   # placements differ: stock path
    "grad-shard": ("R", "S0"),       # placements differ: stock path
    "plain": (None, None),
}
LOCAL = {"shard0", "shard1", "replicate"}
CASES = [(o, lay) for o in OPTIMIZERS for lay in LAYOUTS]


# -- the worker (torchrun runs this file) ------------------------------------------------------

def _placement(text: str, ndim: int):
    from torch.distributed.tensor import Replicate, Shard
    return Replicate() if text == "R" else Shard(min(int(text[1]), ndim - 1))


def _make(tensor: torch.Tensor, text: str | None, mesh) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor
    # distribute_tensor may keep ``tensor`` itself as the local shard (Replicate): clone it,
    # or both optimizers would step one shared storage
    tensor = tensor.clone()
    return tensor if text is None else distribute_tensor(tensor, mesh,
                                                         [_placement(text, tensor.ndim)])


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def _layout(t: torch.Tensor):
    from torch.distributed.tensor import DTensor
    return tuple(map(str, t.placements)) if isinstance(t, DTensor) else None


def run_case(opt_name: str, layout: str, mesh, monkeypatch_paths: list) -> dict:
    stock_cls, local_cls, kwargs = OPTIMIZERS[opt_name]
    p_text, g_text = LAYOUTS[layout]
    seed = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=seed) for s in SHAPES]
    out = {}
    for which, cls in (("stock", stock_cls), ("ours", local_cls)):
        params = [torch.nn.Parameter(_make(t, p_text, mesh)) for t in init]
        opt = cls(params, **kwargs)
        gen = torch.Generator().manual_seed(1)  # the same gradients for both
        monkeypatch_paths.clear()
        for _ in range(STEPS):
            for p, s in zip(params, SHAPES, strict=True):
                p.grad = _make(torch.randn(s, generator=gen), g_text, mesh)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[which] = {
            "params": [_full(p.detach()) for p in params],
            "state": [{k: _full(v) for k, v in opt.state[p].items()} for p in params],
            "param_layout": [_layout(p) for p in params],
            "state_layout": [{k: _layout(v) for k, v in opt.state[p].items()} for p in params],
            "state_types": [{k: type(v).__name__ for k, v in opt.state[p].items()}
                            for p in params],
            "paths": list(monkeypatch_paths),
            "is_stock_class": isinstance(opt, stock_cls),
            "state_dict_keys": sorted(opt.state_dict()["param_groups"][0]),
        }
    return out


def worker(out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import meshplan.runtime.graph.optim as optim

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    paths = []  # one entry per call of the functional update that our step makes

    def spy(real):
        def call(params, *args, **kwargs):
            paths.append("dtensor" if any(isinstance(p, DTensor) for p in params) else "local")
            return real(params, *args, **kwargs)
        return call

    optim.adam, optim.sgd = spy(optim.adam), spy(optim.sgd)  # only our classes call these
    results = {f"{o}/{lay}": run_case(o, lay, mesh, paths) for o, lay in CASES}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()  # no rank tears gloo down while a peer still works (aborts)
    dist.destroy_process_group()


# -- the tests -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from _launch import forked_results

    return forked_results(__file__, tmp_path_factory.mktemp("optim") / "results.pt")


@pytest.mark.parametrize("opt_name,layout", CASES)
def test_steps_equal_stock_optimizer(results, opt_name, layout):
    got = results[f"{opt_name}/{layout}"]
    stock, ours = got["stock"], got["ours"]
    # an elementwise update on matching shards is exact, so demand bitwise equality
    for i, (a, b) in enumerate(zip(stock["params"], ours["params"], strict=True)):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"param {i}: {m}")
    for i, (a, b) in enumerate(zip(stock["state"], ours["state"], strict=True)):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=0,
                                       msg=lambda m: f"param {i} state {k}: {m}")
    # the state is what torch creates: same keys, types and placements (checkpoints)
    assert ours["state_types"] == stock["state_types"]
    assert ours["state_layout"] == stock["state_layout"]
    assert ours["param_layout"] == stock["param_layout"]
    assert ours["is_stock_class"] and ours["state_dict_keys"] == stock["state_dict_keys"]


@pytest.mark.parametrize("opt_name,layout", CASES)
def test_path_taken(results, opt_name, layout):
    paths = results[f"{opt_name}/{layout}"]["ours"]["paths"]
    # plain tensors take the stock path with plain tensors (see the in-process test)
    assert paths == ["local" if layout in LOCAL | {"plain"} else "dtensor"] * STEPS


def test_plain_parameters_step_like_stock_in_process():
    from meshplan.runtime.graph.optim import _split

    torch.manual_seed(0)
    init = [torch.randn(4, 3), torch.randn(5)]
    assert _split(init, [t.clone() for t in init]) == ([], [0, 1])  # the stock path
    for stock_cls, ours_cls, kwargs in OPTIMIZERS.values():
        a = [torch.nn.Parameter(t.clone()) for t in init]
        b = [torch.nn.Parameter(t.clone()) for t in init]
        opt_a, opt_b = stock_cls(a, **kwargs), ours_cls(b, **kwargs)
        for step in range(STEPS):
            for pa, pb in zip(a, b, strict=True):
                pa.grad = torch.full_like(pa, 0.1 * (step + 1))
                pb.grad = pa.grad.clone()
            opt_a.step()
            opt_b.step()
        for pa, pb in zip(a, b, strict=True):
            torch.testing.assert_close(pb, pa, rtol=0, atol=0)
        # state_dict round-trips between the two classes
        opt_a.load_state_dict(opt_b.state_dict())
        assert opt_a.state_dict()["param_groups"] == opt_b.state_dict()["param_groups"]


@pytest.mark.parametrize("cls,option", [(LocalShardAdam, "foreach"), (LocalShardAdam, "fused"),
                                        (LocalShardAdam, "capturable"),
                                        (LocalShardSGD, "foreach")])
def test_unsupported_options_raise(cls, option):
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(NotSupportedError, match=f"{option}=True"):
        cls([p], lr=1e-3, **{option: True})
    opt = cls([p], lr=1e-3)
    with pytest.raises(NotSupportedError, match=f"{option}=True"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], option: True})


def test_make_optimizer_builds_local_shard_classes():
    from types import SimpleNamespace

    from meshplan.runtime.graph.parallelize import make_optimizer

    p = torch.nn.Parameter(torch.zeros(2))
    for name, cls, stock in (("adam", LocalShardAdam, torch.optim.Adam),
                             ("sgd", LocalShardSGD, torch.optim.SGD)):
        plan = SimpleNamespace(training=SimpleNamespace(optimizer=name))
        opt = make_optimizer({"w": p}, plan, lr=0.5)
        assert type(opt) is cls and isinstance(opt, stock)
        assert opt.param_groups[0]["lr"] == 0.5


if __name__ == "__main__":
    worker(sys.argv[1])
