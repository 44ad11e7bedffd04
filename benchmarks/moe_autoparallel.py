"""meshplan.autoparallel on mixture-of-experts models at scale (issue 39): the layout it picks
(ep searched jointly with dp/tp/cp/pp, microbatch, recompute and ZeRO), its predicted
throughput, MFU and peak memory, and the planning time (wall and CPU seconds: the machine
these ran on is shared, so the CPU time is the comparable figure).

Run: python benchmarks/moe_autoparallel.py MODEL_PRESET GLOBAL_BATCH MESH
e.g. python benchmarks/moe_autoparallel.py qwen3-235b-a22b 8192 dgx-h100:nodes=32
Prints one JSON line; results by hand in benchmarks/results/moe_autoparallel.md. The traced
graph is kept in $TMPDIR (moeprice-*.pkl) so a second search skips the export.
"""
import json
import os
import pickle
import sys
import tempfile
import time
import warnings
warnings.simplefilter("ignore")
import meshplan
from meshplan.specs import parse_model_spec, parse_mesh_spec, training_call
name, batch, mesh = sys.argv[1], int(sys.argv[2]), sys.argv[3]
seq = 4096
model = parse_model_spec(name).build("meta")
path = os.path.join(tempfile.gettempdir(), f"moeprice-{name}-{batch}.pkl")
t = time.time()
if os.path.exists(path):
    g = pickle.load(open(path, "rb"))
else:
    call = training_call(model, batch, seq)
    g = meshplan.trace(model, call.inputs, example_targets=call.targets, model_name=name)
    pickle.dump(g, open(path, "wb"))
trace_s = time.time() - t
t = time.time(); c = time.process_time()
plan = meshplan.autoparallel(model, parse_mesh_spec(mesh), graph=g)
plan_s = time.time() - t; plan_cpu_s = time.process_time() - c
e = meshplan.estimate(plan, g)
n = plan.num_devices
out = dict(model=name, mesh=mesh, global_batch=batch, seq=seq, trace_s=trace_s, plan_s=plan_s, plan_cpu_s=plan_cpu_s,
           wall_time_s=plan.wall_time_s, engine=plan.engine,
           stages=[dict(mesh=s.mesh_shape, axes=s.axis_names, ep=s.ep, zero=s.zero, recompute=s.recompute, layers=s.layers) for s in plan.stages],
           pp=plan.num_stages, microbatches=plan.training.microbatches, mbs=plan.training.microbatch_size,
           schedule=plan.training.schedule, tokens_per_gpu=e.tokens_per_s / n, mfu=e.mfu,
           peak_gib=e.peak_memory_gib, fits=e.fits, step_s=e.step_time_s)
print(json.dumps(out))
