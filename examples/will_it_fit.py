"""Will it fit: the fewest H100 nodes a model trains on, and the fastest layouts on a mesh.

    python examples/will_it_fit.py [--model SPEC] [--batch B] [--seq S] [--nodes N] [--check]

What ``meshplan fit`` answers (docs/cli-json.md), from Python: ``meshplan.fit`` returns a
frozen ``FitAnswer``; each layout carries its peak memory per GPU broken down and the
``--manual`` string that rebuilds it. The default model is a Llama of 16 wide blocks
(Llama 3.1 405B's width, ~57 B parameters: more than one 8-GPU node holds), planned on the
meta device: no GPU and no weights. ``--model llama3.1-405b --batch 2048 --seq 8192
--nodes 128`` asks the real question (about a minute of CPU). ``--check`` rebuilds the
smallest mesh's layout with ``meshplan.manual_plan`` and asserts that it fits there, with
the same peak memory, and that the fastest layouts fit, fastest first.
"""

import argparse
import sys

import meshplan
from meshplan.specs import parse_manual_spec, parse_model_spec

WIDE = ("transformers:llama?hidden_size=16384&intermediate_size=53248&num_hidden_layers=16"
        "&num_attention_heads=128&num_key_value_heads=8&vocab_size=32000"
        "&max_position_embeddings=8192")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=WIDE)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--nodes", type=int, default=4, help="the mesh to list layouts for")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    spec = parse_model_spec(args.model)
    loaded = spec.load(args.batch, args.seq, device="meta")
    graph = loaded.trace(args.model)
    answer = meshplan.fit(loaded.model, gpu="h100", batch=args.batch, seq=args.seq,
                          mesh=f"dgx-h100:nodes={args.nodes}", graph=graph, top=3,
                          model_name=args.model if len(args.model) < 40 else "wide llama")
    print(answer.text())
    if args.check:
        n, lay = answer.smallest_nodes, answer.smallest
        assert n is not None, "nothing fits"
        plan = meshplan.manual_plan(loaded.model, meshplan.Mesh.preset("dgx-h100", nodes=n),
                                    graph=graph, engine=answer.target,
                                    **parse_manual_spec(lay.manual))
        assert plan.predicted.fits, plan.predicted.overflow
        assert abs(plan.predicted.peak_memory_gib - lay.peak_memory_gib) <= \
            1e-9 * lay.peak_memory_gib, (plan.predicted.peak_memory_gib, lay.peak_memory_gib)
        times = [f.step_time_s for f in answer.fastest]
        assert answer.fastest and times == sorted(times)
        assert all(f.fits and f.peak_memory_gib <= answer.memory_gib for f in answer.fastest)
        print(f"checked: {lay.manual} fits on {n} nodes as manual_plan prices it; "
              f"{len(times)} fastest layouts fit, fastest first")
    return 0


if __name__ == "__main__":
    sys.exit(main())
