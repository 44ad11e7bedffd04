"""Plan a Llama-style model for torchtitan and for Megatron-LM, export, read back, compare.

    python examples/stacks_export.py [--out DIR] [--check]

What a user of those stacks does with meshplan (docs/torchtitan.md, docs/megatron.md):
1. ``meshplan.plan_for(model, mesh, "torchtitan")``: the best layout torchtitan runs (FSDP2,
   TP with sequence parallel, CP, pipeline schedules), priced as torchtitan runs it;
2. ``meshplan.export_plan(plan, "torchtitan")``: its torchtitan 0.3 config_registry.py (and for Megatron-LM, the
   ``pretrain_gpt.py`` arguments);
3. ``meshplan.import_plan(file, target, mesh)``: a configuration file read back and priced.
``--check`` asserts that the file read back is the same layout with the same prediction.
The model is a small Llama (torchtitan's debug flavor, random weights, nothing downloaded) on two 8-GPU H100 nodes,
planned on the meta device: no GPU is needed.
"""

import argparse
import os
import sys
import tempfile

import torch

import meshplan
from meshplan.specs import parse_model_spec

# the dimensions of torchtitan's llama3 "debugmodel" flavor: an export to torchtitan names a
# flavor it ships (llama3 8B / 70B / 405B, qwen3 ...); use llama3.1-8b etc. for real runs
SPEC = ("transformers:llama?hidden_size=256&intermediate_size=768&num_hidden_layers=6"
        "&num_attention_heads=16&num_key_value_heads=16&vocab_size=2048"
        "&max_position_embeddings=131072&rope_theta=500000&rms_norm_eps=1e-05")
BATCH, SEQ = 32, 4096


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="", help="where the plans and files go (default: temp)")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="meshplan-stacks-")
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = parse_model_spec(SPEC).build(device="meta")
    ids = torch.zeros((BATCH, SEQ), dtype=torch.long, device="meta")
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=2)
    graph = meshplan.trace(model, (ids,), model_name="llama-small")
    for target, suffix in (("torchtitan", "_config_registry.py"), ("megatron", ".txt")):
        plan = meshplan.plan_for(model, mesh, target, graph=graph).with_spec(SPEC)
        plan.to_json(os.path.join(out, f"plan_{target}.json"))
        text = meshplan.export_plan(plan, target)
        path = os.path.join(out, f"{target}{suffix}")
        with open(path, "w") as f:
            f.write(text)
        back = meshplan.import_plan(path, target, mesh, model_spec=SPEC)
        p, q = plan.predicted, back.predicted
        print(f"{target}: {plan.solver.status}; step {p.step_time_s * 1e3:.1f} ms, MFU "
              f"{p.mfu:.1%}, {p.peak_memory_gib:.2f} GiB -> {path}")
        print(f"  read back: step {q.step_time_s * 1e3:.1f} ms, {q.peak_memory_gib:.2f} GiB")
        if args.check:
            from meshplan.stacks import layout_of

            assert layout_of(back, compiled=back.training.compiled) == \
                layout_of(plan, compiled=plan.training.compiled), (target, layout_of(back))
            assert abs(q.step_time_s - p.step_time_s) <= 1e-9 * p.step_time_s, (p, q)
            assert abs(q.peak_memory_gib - p.peak_memory_gib) <= 1e-9 * p.peak_memory_gib
    if args.check:
        print("read back: same layouts, same predictions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
