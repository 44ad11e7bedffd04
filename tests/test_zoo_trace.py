"""Tracing the model families people train: blocks in any container, encoder-decoder
stacks, lifted constants (tiny configs on the meta device)."""

import pytest
import torch

import meshplan
from meshplan.tracing import find_block_paths
from meshplan.specs import parse_model_spec
from _zoo_models import ConvNet, TitanLlama

B, S = 8, 16
T5 = "transformers:t5?d_model=64&d_ff=128&num_layers=2&num_heads=4&vocab_size=256&d_kv=16"
FALCON = "transformers:falcon?hidden_size=64&num_hidden_layers=2&num_attention_heads=4&vocab_size=256"
BART = ("transformers:bart?d_model=64&encoder_ffn_dim=128&decoder_ffn_dim=128&encoder_layers=2"
        "&decoder_layers=2&encoder_attention_heads=4&decoder_attention_heads=4&vocab_size=256"
        "&max_position_embeddings=64")
BERT = ("transformers:bert?hidden_size=64&intermediate_size=128&num_hidden_layers=2"
        "&num_attention_heads=4&vocab_size=256")
VIT = ("transformers:vit?hidden_size=64&intermediate_size=128&num_hidden_layers=2"
       "&num_attention_heads=4&image_size=32&patch_size=8&num_labels=10")


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
    # margin=0: the fastest plan, not the simplest within the cost model's error (on local:4
    # a 2-stage pipeline cut between the stacks is within 17.8% of it)
    plan = meshplan.autoparallel(model, parse_mesh_spec(mesh), graph=g, microbatches=[4, 8],
                                 margin=0.0)
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
    from meshplan.tracing import TrainingModule, export_training_graph, flatten_call
    from meshplan.runtime.graph.programs import runnable_graph_module

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


# -- every operator's work counted ----------------------------------------------------------

LLAMA = ("transformers:llama?hidden_size=128&intermediate_size=320&num_hidden_layers=2"
         "&num_attention_heads=4&num_key_value_heads=4&vocab_size=256")


def active_params(model, top_k=1, num_experts=1) -> int:
    """Parameters one token passes through in matmuls: all but the input embeddings (an
    embedding tied to the output projection counts once, as that projection), and of the
    routed experts' weights only top_k of num_experts (Fedus et al. 2021, Switch, sec. 2)."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    embeddings = {id(m.weight) for m in model.modules()
                  if isinstance(m, torch.nn.Embedding) and id(m.weight) not in linear}
    total = 0
    for name, p in model.named_parameters():
        if id(p) in embeddings:
            continue
        share = top_k / num_experts if ".experts." in name and "shared" not in name else 1
        total += p.numel() * share
    return int(total)


GPT2 = "transformers:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256&n_positions=64"


@pytest.mark.parametrize("text,top_k,experts", [
    (GPT2, 1, 1), (LLAMA, 1, 1), (MIXTRAL, 2, 4), (OLMOE, 2, 4), (BART, 1, 1)],
    ids=["gpt2", "llama", "mixtral", "olmoe", "bart"])
def test_training_flops_are_6_x_active_params_x_tokens(text, top_k, experts):
    # Kaplan et al. 2020 (Scaling Laws, section 2.1): training FLOPs ~ 6 N D for N (active,
    # non-embedding) parameters and D tokens; attention adds 4*s*h per layer per token
    from meshplan.specs import training_call
    model = _build(text)
    batch, seq = 4, 32
    call = training_call(model, batch, seq)
    g = meshplan.trace(model, call.inputs, example_targets=call.targets)
    ratio = g.train_flops / (6 * active_params(model, top_k, experts) * batch * seq)
    assert 0.75 <= ratio <= 1.25, ratio
    grouped = [n for n in g.nodes if "grouped_mm" in n.target]
    assert (experts > 1) == bool(grouped) and all(n.flops > 0 for n in grouped)


def test_convnet_flops_match_the_closed_form():
    with torch.device("meta"):
        model = ConvNet()
    images = torch.zeros(8, 3, 32, 32, device="meta")
    labels = torch.zeros(8, dtype=torch.long, device="meta")
    g = meshplan.trace(model, images, example_targets=labels)
    assert g.forward_flops == model.closed_form_flops(8, 32)
    convs = [n for n in g.nodes if "conv" in n.target]
    assert len(convs) == 1 + 2 * 6 + 2 and all(n.flops > 0 for n in convs)


class Mixers(torch.nn.Module):
    """einsum (with an ellipsis), bmm, a transposed convolution and grouped attention."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(16, 24))
        self.up = torch.nn.ConvTranspose1d(16, 8, 3)

    def forward(self, x):  # x: (2, 10, 16)
        a = torch.einsum("...i,ij->...j", x, self.w)  # 2*2*10*16*24
        b = torch.bmm(a, a.transpose(1, 2))  # 2*2*10*24*10
        q = x.view(2, 10, 4, 4).transpose(1, 2)
        c = torch.nn.functional.scaled_dot_product_attention(q, q, q)  # 2*2*4*10*10*(4+4)
        d = self.up(x.transpose(1, 2))  # 2 * 16*3*8 * 10 per image
        return a.sum() + b.sum() + c.sum() + d.sum()


def test_einsum_bmm_attention_and_transposed_conv_are_counted():
    with torch.device("meta"):
        model = Mixers()
    g = meshplan.trace(model, torch.zeros(2, 10, 16, device="meta"),
                       loss_fn=lambda out, *rest: out)
    by_kind = {n.target.split(".")[1]: n.flops for n in g.nodes if n.flops}
    assert by_kind["einsum"] == 2 * 2 * 10 * 16 * 24
    assert by_kind["bmm"] == 2 * 2 * 10 * 24 * 10
    assert by_kind["scaled_dot_product_attention"] == 2 * 2 * 4 * 10 * 10 * 8
    assert by_kind["conv_transpose1d"] == 2 * 2 * 16 * 3 * 8 * 10


@torch.library.custom_op("zoo_test::blend", mutates_args=())
def blend(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


@blend.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


class CustomOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(16, 16))

    def forward(self, x):
        return torch.ops.zoo_test.blend(torch.ops.zoo_test.blend(x, self.w), self.w)


def test_unknown_operators_are_listed_in_one_warning():
    from meshplan.tracing import UncountedOperatorsWarning
    with torch.device("meta"):
        model = CustomOp()
    with pytest.warns(UncountedOperatorsWarning) as record:
        meshplan.trace(model, torch.zeros(4, 16, device="meta"), loss_fn=lambda o, *r: o.sum())
    mine = [w for w in record if w.category is UncountedOperatorsWarning]
    assert len(mine) == 1
    msg = str(mine[0].message)
    assert "zoo_test.blend.default x2" in msg and "% of the graph's bytes" in msg


def test_known_models_warn_of_nothing(recwarn):
    from meshplan.tracing import UncountedOperatorsWarning
    meshplan.trace(_build(MIXTRAL), _ids())
    assert not [w for w in recwarn if w.category is UncountedOperatorsWarning]


# -- transformers:NAME builds the head its users train ---------------------------------------



@pytest.mark.parametrize("text,cls,head", [
    (BART, "BartForConditionalGeneration", "seq2seq"),
    (T5, "T5ForConditionalGeneration", "seq2seq"),
    (BERT, "BertForMaskedLM", "masked-lm"),
    (BERT + "&head=causal-lm", "BertLMHeadModel", "causal-lm"),
    (LLAMA, "LlamaForCausalLM", "causal-lm"),
    (VIT, "ViTForImageClassification", "image-classification"),
])
def test_transformers_spec_builds_the_head_users_train(text, cls, head):
    from meshplan.specs import model_head, training_call
    model = _build(text)
    assert type(model).__name__ == cls and model_head(model) == head
    dropouts = {k: v for k, v in model.config.to_dict().items()
                if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, float)}
    assert dropouts and not any(dropouts.values())
    call = training_call(model, 4, 16)
    g = meshplan.trace(model, call.inputs, example_targets=call.targets, loss_fn=call.loss_fn)
    assert g.num_layers >= 2 and g.forward_flops > 0
    assert len(g.inputs) == {"causal-lm": 1, "masked-lm": 2, "seq2seq": 3,
                             "image-classification": 2}[head]


def test_bad_head_is_one_line():
    from meshplan.errors import SpecError
    with pytest.raises(SpecError, match="head='mlm' is not one of causal-lm, masked-lm"):
        _build(BERT + "&head=mlm")
    with pytest.raises(SpecError, match="no seq2seq head.*it has: causal-lm"):
        _build(LLAMA + "&head=seq2seq")


def test_synthetic_calls_mask_tokens_and_shift_decoder_ids():
    from meshplan.specs import training_call
    bert = parse_model_spec(BERT).build("cpu")
    a = training_call(bert, 8, 64, device="cpu", seed=3, step=1)
    b = training_call(bert, 8, 64, device="cpu", seed=3, step=1)
    (ids,), (labels,) = a.inputs, a.targets
    torch.testing.assert_close(ids, b.inputs[0])
    masked = labels != -100
    assert 0.05 < masked.float().mean() < 0.3 and (ids[masked] == 255).all()
    bart = parse_model_spec(BART).build("cpu")
    c = training_call(bart, 2, 8, device="cpu", seed=0)
    torch.testing.assert_close(c.inputs["decoder_input_ids"][:, 1:], c.targets[0][:, :-1])
    loss = meshplan.tracing.TrainingModule(bart, None, meshplan.tracing.flatten_call(
        c.inputs, c.targets)[1])(*c.inputs.values(), *c.targets)
    assert loss.ndim == 0 and 4 < loss.item() < 7  # about log(256) = 5.5 at random weights


class DecoderFirst(torch.nn.Module):
    """Two stacks registered in the opposite order to the one they run in."""

    def __init__(self):
        super().__init__()
        self.decoder = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.encoder = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for block in [*self.encoder, *self.decoder]:
            x = block(x)
        return x


def test_layer_indices_follow_the_order_blocks_run_in():
    with torch.device("meta"):
        model = DecoderFirst()
    g = meshplan.trace(model, torch.zeros(4, 8, device="meta"), loss_fn=lambda o, *r: o.sum())
    layers = [(n.layer, n.params[0].rsplit(".", 1)[0]) for n in g.nodes if n.params]
    assert layers == [(0, "encoder.0"), (1, "encoder.1"), (2, "encoder.2"), (3, "decoder.0"),
                      (4, "decoder.1")]


def test_resnet50_flops_match_the_published_count():
    # He et al. 2016, table 1: ResNet-50 is 3.8e9 multiply-adds per 224x224 image, i.e.
    # 7.6e9 FLOPs at 2 FLOPs per multiply-add (torchvision lists 4.09e9 with its stride-2
    # 3x3 convolutions, as written here)
    from _zoo_models import ResNet50
    with torch.device("meta"):
        model = ResNet50()
    g = meshplan.trace(model, torch.zeros(2, 3, 224, 224, device="meta"),
                       example_targets=torch.zeros(2, dtype=torch.long, device="meta"))
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's count
    assert g.forward_flops / 2 == pytest.approx(2 * 3.8e9, rel=0.25)
    assert g.forward_flops / 2 == pytest.approx(2 * 4.09e9, rel=0.01)
    assert g.num_layers == 16
