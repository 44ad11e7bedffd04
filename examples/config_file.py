"""Plan and train a model from a Hugging Face ``config.json`` (no weights, no query string),
in your own training loop.

    torchrun --nproc-per-node 4 examples/config_file.py [--steps N] [--check]
    python examples/config_file.py --check     # the same, as one process

The config is a small Qwen3 written as a checkpoint's ``config.json`` into ``--plan-dir``;
``meshplan.model_from_config`` builds it on meta for the plan (``meshplan plan --model
that/config.json`` does the same on the command line) and on the CPU for the weights. With
``--check`` rank 0 also trains the same steps in plain PyTorch on the whole global batch and
asserts that the losses, and the weights after the last step, are equal.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist

import meshplan
from common import check_losses, init_distributed, log, parse_args, plan_on_rank0, rows

BATCH, SEQ, LR, CLIP = 8, 32, 3e-3, 1.0
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
          "max_position_embeddings": SEQ, "rope_theta": 1000000.0, "attention_dropout": 0.0,
          "tie_word_embeddings": True}


def write_config(plan_dir: str) -> str:
    """Rank 0 writes config.json (as a checkpoint folder holds it); every rank gets its path."""
    path = [None]
    if dist.get_rank() == 0:
        folder = plan_dir or tempfile.mkdtemp(prefix="meshplan-config-")
        os.makedirs(folder, exist_ok=True)
        path[0] = os.path.join(folder, "config.json")
        with open(path[0], "w") as f:
            json.dump(CONFIG, f, indent=1)
    dist.broadcast_object_list(path, src=0)
    return path[0]


def global_batch(step: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)


def train_plain(state, config_path, args):
    """The same steps in plain PyTorch, one process, whole global batch (--check)."""
    model = meshplan.model_from_config(config_path, device="cpu")
    model.load_state_dict(state, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(args.steps):
        x = global_batch(step, args.seed)
        logits = model(x).logits[:, :-1]  # meshplan's default loss: the next token
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def main():
    args = parse_args(__doc__.splitlines()[0])
    init_distributed()
    config_path = write_config(args.plan_dir)
    model = meshplan.model_from_config(config_path)          # on meta: nothing allocated
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")  # one GLOBAL batch
    plan = plan_on_rank0(model, plan_dir=args.plan_dir, example_inputs=(ids,))
    run = meshplan.parallelize(model, plan)

    state = None
    if dist.get_rank() == 0:  # a seeded CPU model; rank 0 alone holds its full weights
        torch.manual_seed(args.seed)
        cpu = meshplan.model_from_config(config_path, device="cpu")
        state = {**cpu.state_dict(), **dict(cpu.named_buffers())}  # + rotary inv_freq
    run.load_full_state_dict(state, broadcast_from_rank0=True)

    opt = torch.optim.AdamW(run.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(args.steps):
        loss = run.train_step((rows(global_batch(step, args.seed), run),))
        norm = run.clip_grad_norm_(CLIP)
        opt.step(), opt.zero_grad()
        losses.append(loss)
        log(f"step {step}  loss {loss:.6f}  grad norm {norm:.4f}")
    trained = run.full_state_dict()  # a collective: every rank calls it

    if args.check and dist.get_rank() == 0:
        ref_losses, ref_state = train_plain(state, config_path, args)
        log("one process:", ", ".join(f"{v:.6f}" for v in ref_losses))
        check_losses(losses, ref_losses)
        for name, value in trained.items():  # 1e-4: the project's floor for weights (AdamW
            # turns summation-order noise in a near-zero gradient into up to lr per element)
            torch.testing.assert_close(value, ref_state[name], rtol=0, atol=1e-4,
                                       msg=lambda m, n=name: f"{n}: {m}")
        print("weights equal one process", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
