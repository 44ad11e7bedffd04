"""Trace time and peak memory per model, each traced in a fresh process on the meta device.

Run: python benchmarks/trace_models.py [--quick]
Prints a table and writes benchmarks/results/trace_models.md. Peak RSS is the process's
ru_maxrss (it includes the ~0.5 GB of importing torch and transformers); the bound the
foundation issue sets is 4 GB for GPT-3 175B, whose fp32 weights alone would be 700 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODELS = [
    ("gpt2 (124M)", "gpt2-small", 8, 1024),
    ("GPT-3 1.3B", "gpt3-1.3b", 8, 2048),
    ("GPT-3 13B", "gpt3-13b", 8, 2048),
    ("GPT-3 175B", "gpt3-175b", 8, 2048),
    ("Llama-2 7B", "llama2-7b", 8, 4096),
    ("Llama-2 70B", "llama2-70b", 8, 4096),
    ("BERT-large", "bert-large", 8, 512),
    ("Mixtral-style MoE (8 experts, 4 layers)",
     "transformers:mixtral?hidden_size=1024&intermediate_size=3584&num_hidden_layers=4"
     "&num_attention_heads=16&num_key_value_heads=8&vocab_size=32000&num_local_experts=8", 8, 1024),
    ("T5 (encoder-decoder, 6+6 layers)",
     "transformers:t5?d_model=512&d_ff=2048&num_layers=6&num_heads=8&vocab_size=32128&d_kv=64", 8, 512),
]

CHILD = """
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
import meshplan
from meshplan.specs import parse_model_spec, example_inputs
spec = parse_model_spec(sys.argv[1]); batch, seq = int(sys.argv[2]), int(sys.argv[3])
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
m = spec.build("meta")
t = time.perf_counter()
g = meshplan.trace(m, example_inputs(m, batch, seq))
elapsed = time.perf_counter() - t
print(json.dumps(dict(seconds=elapsed, nodes=len(g.nodes), layers=g.num_layers,
      identical=g.layers_identical, params=g.param_count, tflops=g.train_flops / 1e12,
      rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
      import_rss_gib=rss0 / 2**20)))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the largest models")
    args = ap.parse_args()
    rows = []
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    for title, spec, batch, seq in MODELS:
        if args.quick and any(k in spec for k in ("175b", "70b")):
            continue
        out = subprocess.run([sys.executable, "-c", CHILD, spec, str(batch), str(seq)],
                             capture_output=True, text=True, env=env)
        if out.returncode != 0:
            rows.append((title, f"FAILED: {out.stderr.strip().splitlines()[-1][:80]}"))
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((title, f"{r['params'] / 1e9:.2f}B", f"{batch}x{seq}", str(r["nodes"]),
                     f"{r['layers']}{' (identical)' if r['identical'] else ''}",
                     f"{r['tflops']:.1f}", f"{r['seconds']:.2f}", f"{r['rss_gib']:.2f}"))
        print(" | ".join(rows[-1]), flush=True)
    header = ("model", "params", "batch x seq", "nodes", "blocks", "train TFLOP/step",
              "trace s", "peak RSS GiB")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    table = "\n".join(lines)
    print("\n" + table)
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "trace_models.md"), "w") as f:
        f.write("# Tracing on the meta device (2-core CPU machine)\n\n"
                "Command: `python benchmarks/trace_models.py`\n\n" + table + "\n")


if __name__ == "__main__":
    main()
