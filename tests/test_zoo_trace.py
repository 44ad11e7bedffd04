"""Tracing the model families people train: blocks in any container, encoder-decoder
stacks, lifted constants (tiny configs on the meta device)."""

import pytest
import torch

import meshplan
from meshplan.planner.trace import find_block_paths
from meshplan.specs import example_inputs, parse_model_spec
from tests._zoo_models import ConvNet, TitanLlama

B, S = 8, 16
T5 = "transformers:t5?d_model=64&d_ff=128&num_layers=2&num_heads=4&vocab_size=256&d_kv=16"
FALCON = "transformers:falcon?hidden_size=64&num_hidden_layers=2&num_attention_heads=4&vocab_size=256"


def _ids(batch=B, seq=S):
    return (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)


def _build(text):
    return parse_model_spec(text).build()


def _cuts(plan):
    return [s.layers for s in plan.stages]


def test_blocks_in_a_module_dict_are_layers():
    with torch.device("meta"):
        model = TitanLlama(n_layers=3)
    g = meshplan.trace(model, _ids())
    assert g.num_layers == 3 and g.layers_identical and g.block_module == "layers"
    wq = next(n for n in g.nodes if n.params == ("layers.2.attention.wq.weight",))
    assert wq.layer == 2
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(4), example_inputs=_ids(), dp=2, pp=2,
                                graph=g)
    assert _cuts(plan) == [(0, 2), (2, 3)]


def test_sequential_stacks_of_a_convnet_are_layers():
    with torch.device("meta"):
        model = ConvNet(blocks_per_stage=2)
    assert find_block_paths(model) == tuple(f"blocks.{i}" for i in range(6))


def test_encoder_and_decoder_stacks_are_both_blocks():
    model = _build(T5)
    assert find_block_paths(model) == ("encoder.block.0", "encoder.block.1",
                                       "decoder.block.0", "decoder.block.1")
    g = meshplan.trace(model, _ids())
    assert g.num_layers == 4
    layer_of = {n.module_path.split(".")[0]: set() for n in g.nodes if n.layer >= 0}
    for n in g.nodes:
        if n.layer >= 0:
            layer_of[n.module_path.split(".")[0]].add(n.layer)
    assert layer_of == {"encoder": {0, 1}, "decoder": {2, 3}}
    # pp=4 cuts inside the encoder and inside the decoder (before: the whole encoder in stage 0)
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(4), example_inputs=_ids(), pp=4,
                                graph=g)
    assert _cuts(plan) == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("mesh", ["local:4", "dgx-h100:nodes=2"])
def test_autoparallel_cuts_inside_the_stacks(mesh):
    from meshplan.specs import parse_mesh_spec
    model = _build(T5)
    g = meshplan.trace(model, _ids(64, S))
    plan = meshplan.autoparallel(model, parse_mesh_spec(mesh), graph=g, microbatches=[4, 8])
    bounds = {c[1] for c in _cuts(plan)[:-1]}
    # tiny blocks and a large batch: a pipeline wins, and a cut lands inside a stack (the
    # encoder is blocks 0-1, the decoder 2-3); before, the encoder was one unit
    assert plan.model.num_layers == 4 and bounds & {1, 3}, _cuts(plan)


def test_lifted_tensor_constants_are_not_model_inputs():
    model = _build(FALCON)
    g = meshplan.trace(model, _ids())
    assert [name for name, _ in g.inputs] == ["inputs_0"]
    index = [n for n in g.nodes if any("lifted_tensor" in i for i in n.inputs)]
    assert index and all(n.layer >= 0 for n in index)
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(4), example_inputs=_ids(), dp=2, pp=2,
                                graph=g)
    assert plan.training.global_batch == B and _cuts(plan) == [(0, 1), (1, 2)]


MIXTRAL = ("transformers:mixtral?hidden_size=64&intermediate_size=128&num_hidden_layers=2"
           "&num_attention_heads=4&num_key_value_heads=4&vocab_size=256&num_local_experts=4"
           "&num_experts_per_tok=2")
OLMOE = ("transformers:olmoe?hidden_size=64&intermediate_size=128&num_hidden_layers=2"
         "&num_attention_heads=4&num_key_value_heads=4&vocab_size=256&num_experts=4"
         "&num_experts_per_tok=2")


@pytest.mark.parametrize("text", [MIXTRAL, OLMOE], ids=["mixtral", "olmoe"])
def test_moe_graph_traced_on_meta_runs_a_training_step_on_cpu(text):
    """On the meta device transformers' routing takes histc on int32, which CPU cannot run;
    the trace is made for CPU, so the graph runs and equals the eager model."""
    from meshplan.planner.trace import TrainingModule, export_training_graph, flatten_call
    from meshplan.runtime.parallelize import runnable_graph_module

    spec = parse_model_spec(text)
    ep = export_training_graph(spec.build(), _ids())
    assert all(v.is_meta for v in ep.state_dict.values())  # no weight was allocated
    histc = [n for n in ep.graph.nodes if n.target is torch.ops.aten.histc.default]
    assert histc and all(n.args[0].meta["val"].dtype.is_floating_point for n in histc)
    gm = runnable_graph_module(ep, device_type="cpu")
    torch.manual_seed(0)
    model = spec.build("cpu")
    ids = torch.randint(0, 256, (B, S))
    params = dict(model.named_parameters())
    state = {f"model.{k}": v for k, v in [*params.items(), *model.named_buffers()]}
    loss = torch.func.functional_call(gm, state, (ids,))
    grads = torch.autograd.grad(loss, list(params.values()))
    ref = TrainingModule(model, None, flatten_call(ids)[1])(ids)
    ref_grads = torch.autograd.grad(ref, list(params.values()))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for name, g, r in zip(params, grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p, g in zip(params.values(), grads):
        p.grad = g
    opt.step()
    after = torch.func.functional_call(gm, state, (ids,))
    assert after.item() < loss.item()
