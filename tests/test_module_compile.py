"""torch.compile as an option of the module engine (per-block, torchtitan style), on one CPU
process; the graph engine refuses it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import meshplan
from meshplan.runtime.launch import free_port
from meshplan.runtime.module_plan import compiler_refusal
from meshplan.specs import parse_model_spec

LLAMA = ("transformers:llama?hidden_size=32&intermediate_size=64&num_hidden_layers=2&"
         "num_attention_heads=4&num_key_value_heads=2&vocab_size=64&max_position_embeddings=32")
BATCH, SEQ = 4, 8


@pytest.fixture(scope="module")
def one_process():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def build(device="cpu"):
    torch.manual_seed(0)
    return parse_model_spec(LLAMA).build(device=device)


def losses(engine: str, compile: bool) -> list[float]:
    model = build()
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    plan = meshplan.manual_plan(build("meta"), meshplan.Mesh.local(1), example_inputs=(ids,),
                                engine=engine)
    run = meshplan.parallelize(model, plan, compile=compile)
    # nn.Module.compile: in place, so the blocks keep their names
    assert all((b._compiled_call_impl is not None) == compile for b in model.model.layers)
    opt = torch.optim.AdamW(run.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        out.append(run.train_step((torch.randint(0, 64, (BATCH, SEQ), generator=g),)))
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.skipif(compiler_refusal() is not None, reason="no C++ compiler for CPU inductor")
def test_compiled_blocks_train_as_eager(one_process):
    eager = losses("modules", compile=False)
    compiled = losses("modules", compile=True)
    # inductor fuses and reorders fp32 reductions: equal to a few ulps, not bitwise
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


def test_graph_engine_refuses_compile(one_process):
    with pytest.raises(meshplan.errors.NotSupportedError, match="module engine only"):
        losses("graph", compile=True)


def test_no_compiler_is_one_clear_line(monkeypatch):
    import shutil

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    why = compiler_refusal()
    assert why is not None and "g++" in why and "compile=False" in why
