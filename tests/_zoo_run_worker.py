"""torchrun worker for tests/test_zoo_run.py: the model zoo run through meshplan.parallelize.

One launch of 4 gloo processes for every family. Each family is built on the meta device,
traced and planned on rank 0 (autoparallel on local:4, and manual plans dp2 x tp2 and
dp2 x pp2, one microbatch each), the plan broadcast, and two steps run through
``meshplan.parallelize`` from the weights of a seeded CPU model; the losses and every
gradient (gathered as full tensors) are saved next to one process running the same steps
on the same weights. A plan meshplan cannot run is recorded with its one-line error.
"""

import sys
import time
import warnings

import torch
import torch.distributed as dist

import meshplan
from meshplan.tracing import TrainingModule, flatten_call
from meshplan.specs import parse_model_spec, training_call

from _zoo_models import ConvNet, TitanLlama

BATCH, SEQ, STEPS, LR = 8, 16, 2, 0.1

FAMILIES = {
    "gpt2": "transformers:gpt2?n_layer=2&n_embd=32&n_head=4&vocab_size=128&n_positions=32",
    "llama": ("transformers:llama?hidden_size=32&intermediate_size=64&num_hidden_layers=2"
              "&num_attention_heads=4&num_key_value_heads=2&vocab_size=128"
              "&max_position_embeddings=32"),
    "falcon": ("transformers:falcon?hidden_size=32&num_hidden_layers=2&num_attention_heads=4"
               "&vocab_size=128"),
    "bert (masked LM)": ("transformers:bert?hidden_size=32&intermediate_size=64"
                         "&num_hidden_layers=2&num_attention_heads=4&vocab_size=128"
                         "&max_position_embeddings=32"),
    "t5 (encoder-decoder)": ("transformers:t5?d_model=32&d_ff=64&num_layers=2&num_heads=4"
                             "&vocab_size=128&d_kv=8"),
    "bart (encoder-decoder)": (
        "transformers:bart?d_model=32&encoder_ffn_dim=64&decoder_ffn_dim=64&encoder_layers=2"
        "&decoder_layers=2&encoder_attention_heads=4&decoder_attention_heads=4"
        "&vocab_size=128&max_position_embeddings=32"),
    "mixtral (MoE)": ("transformers:mixtral?hidden_size=32&intermediate_size=64"
                      "&num_hidden_layers=2&num_attention_heads=4&num_key_value_heads=2"
                      "&vocab_size=128&num_local_experts=4&num_experts_per_tok=2"),
    "olmoe (MoE)": ("transformers:olmoe?hidden_size=32&intermediate_size=64&num_hidden_layers=2"
                    "&num_attention_heads=4&num_key_value_heads=2&vocab_size=128&num_experts=4"
                    "&num_experts_per_tok=2"),
    "vit": ("transformers:vit?hidden_size=32&intermediate_size=64&num_hidden_layers=2"
            "&num_attention_heads=4&image_size=16&patch_size=4&num_labels=10"),
    "convnet (BatchNorm)": "convnet",
    "torchtitan llama (ModuleDict)": "titan",
}
PLANS = {"auto": "auto", "tp": dict(dp=2, tp=2), "pp": dict(dp=2, pp=2)}


def build(family: str, device: str):
    spec = FAMILIES[family]
    if spec == "convnet":
        with torch.device(device):
            return ConvNet(widths=(8, 16), blocks_per_stage=1)
    if spec == "titan":
        with torch.device(device):
            return TitanLlama(vocab_size=128, dim=32, n_layers=2, heads=4, hidden=64, max_seq=32)
    return parse_model_spec(spec).build(device)


def call(family: str, model, device: str, seed=None, batch: int = BATCH):
    """(inputs, targets, loss_fn) of one global batch: specs.training_call for transformers
    models, images + labels / token ids for the hand-written ones."""
    spec = FAMILIES[family]
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    if spec == "convnet":
        x = torch.randn(batch, 3, 8, 8, generator=g) if g else torch.zeros(batch, 3, 8, 8)
        y = torch.randint(0, 10, (batch,), generator=g) if g else torch.zeros(batch, dtype=torch.long)
        return (x.to(device),), (y.to(device),), None
    if spec == "titan":
        ids = torch.randint(0, 128, (batch, SEQ), generator=g) if g else \
            torch.zeros(batch, SEQ, dtype=torch.long)
        return (ids.to(device),), (), None
    c = training_call(model, batch, SEQ, device=device, seed=seed)
    return c.inputs, c.targets, c.loss_fn


def split(inputs, targets, lo, hi):
    ins = {k: v[lo:hi] for k, v in inputs.items()} if isinstance(inputs, dict) else \
        tuple(v[lo:hi] for v in inputs)
    return ins, tuple(t[lo:hi] for t in targets)


def reference(family, state, buffers, dp):
    """One process, the same steps on the whole batch: the runtime's loss is the global
    batch's mean over labelled targets (masked LM's shards hold different numbers of masked
    tokens; runtime/loss_weights.py weighs them). BatchNorm sees the whole batch, as the
    runtime's replicated batch norm does (DECISIONS 18)."""
    model = build(family, "cpu")
    model.load_state_dict({**state, **buffers}, strict=False)
    model.train()
    losses, grads = [], []
    for step in range(STEPS):
        inputs, targets, loss_fn = call(family, model, "cpu", seed=step)
        flat, sig = flatten_call(inputs, targets)
        module = TrainingModule(model, loss_fn, sig)
        chunks = 1
        per = BATCH // chunks
        total = 0.0
        for c in range(chunks):
            loss = module(*(x[c * per:(c + 1) * per] for x in flat)) / chunks
            loss.backward()
            total += loss.item()
        losses.append(total)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None
    return losses, grads


def gathered(mine: dict) -> dict:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = {}
    for part in everyone:
        out.update(part)
    return out


def make_plan(family, options):
    """Plan on rank 0 (the ILP's time limit makes ranks disagree), broadcast as JSON."""
    text = [None]
    if dist.get_rank() == 0:
        try:
            model = build(family, "meta")
            inputs, targets, loss_fn = call(family, model, "meta")
            mesh = meshplan.Mesh.local(dist.get_world_size())
            common = dict(example_inputs=inputs, example_targets=targets, loss_fn=loss_fn)
            if options == "auto":
                plan = meshplan.autoparallel(model, mesh, **common, microbatches=[1],
                                             time_limit_s=10)
            else:
                plan = meshplan.manual_plan(model, mesh, **common,
                                            microbatch_size=BATCH // options["dp"], schedule="gpipe",
                                            **options)
            text[0] = plan.to_json_text()
        except meshplan.MeshplanError as exc:
            text[0] = f"REFUSED {type(exc).__name__}: {exc}"
    dist.broadcast_object_list(text, src=0)
    if text[0].startswith("REFUSED "):
        raise Refused(text[0][8:])
    return meshplan.Plan.from_json_text(text[0])


class Refused(Exception):
    pass


def run_case(family, options, state, buffers):
    plan = make_plan(family, options)
    model = build(family, "meta")
    _, _, loss_fn = call(family, model, "meta")
    try:
        run = meshplan.parallelize(model, plan, loss_fn=loss_fn)
    except meshplan.MeshplanError as exc:
        raise Refused(f"{type(exc).__name__}: {exc}") from None
    run.load_full_state_dict({**state, **buffers}, strict=False)
    opt = torch.optim.SGD(run.parameters(), lr=LR)
    per = BATCH // run.dp_size
    losses, grads = [], []
    for step in range(STEPS):
        inputs, targets, _ = call(family, model, "cpu", seed=step)
        ins, tgs = split(inputs, targets, run.dp_rank * per, (run.dp_rank + 1) * per)
        losses.append(run.train_step(ins, targets=tgs))
        mine = {n: getattr(p.grad, "full_tensor", p.grad.detach)()
                for n, p in run.named_parameters().items() if p.grad is not None}
        grads.append(gathered(mine))
        opt.step()
        opt.zero_grad()
    st = plan.stages[0]
    layout = (f"{run.engine_name} engine, stages={plan.num_stages} mesh={list(st.mesh_shape)} "
              f"zero={st.zero} dp={run.dp_size}")
    return {"losses": losses, "grads": grads, "dp": run.dp_size, "layout": layout}


def main():
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    # argv: out [family:plan,... to skip] (the test skips runs other tests make)
    skip = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else set()
    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = build(family, "cpu")
        state = {k: v.clone() for k, v in model.state_dict().items()}
        buffers = {k: v.clone() for k, v in model.named_buffers()}
        for name, options in PLANS.items():
            if f"{family.split()[0]}:{name}" in skip:
                continue
            t = time.perf_counter()
            try:
                got = run_case(family, options, state, buffers)
                got["ref_losses"], got["ref_grads"] = reference(family, state, buffers, got["dp"])
            except Refused as exc:
                got = {"refused": str(exc)}
            got["seconds"] = time.perf_counter() - t
            out[(family, name)] = got
            if dist.get_rank() == 0:
                print(family, name, f"{got['seconds']:.1f}s", got.get("refused", "ran"),
                      flush=True)
    if dist.get_rank() == 0:
        torch.save(out, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
