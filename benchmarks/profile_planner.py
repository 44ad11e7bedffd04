"""Profile one issue 27 planning case: trace on meta, then meshplan.autoparallel (the CLI's
path), optionally under cProfile.

Run: python benchmarks/profile_planner.py {175b,8b,405b} [prof [TAG]]; with ``prof`` writes
the cumulative and internal-time tables to prof/CASE_TAG.txt (benchmarks/results/
planner_profiles_issue27.md quotes them)."""
import cProfile, pstats, sys, time, warnings, io
import torch
warnings.simplefilter("ignore")
torch.set_num_threads(1)
import os
import meshplan
from meshplan.specs import parse_model_spec, parse_mesh_spec, example_inputs
from meshplan.tracing import trace

from planner_scaling import HYBRID  # the issue 27 targets, one list for both scripts

CASES = dict(zip(("175b", "8b", "405b"), (case[1:] for case in HYBRID)))
name = sys.argv[1]
prof = len(sys.argv) > 2 and sys.argv[2] == "prof"
spec, meshs, batch, seq, cps = CASES[name]
mesh = parse_mesh_spec(meshs)
model = parse_model_spec(spec).build("meta")
t0 = time.perf_counter()
graph = trace(model, example_inputs(model, batch, seq), model_name=spec)
t1 = time.perf_counter()
pr = cProfile.Profile()
if prof: pr.enable()
plan = meshplan.autoparallel(model, mesh, graph=graph, dtype="bf16", context_parallel=cps)
if prof: pr.disable()
t2 = time.perf_counter()
st = plan.stages[0]
print(f"{name}: trace {t1-t0:.1f}s plan {t2-t1:.1f}s  pp={plan.num_stages} mesh={st.mesh_shape} axes={st.axis_names} "
      f"mb={plan.training.microbatches} sched={plan.training.schedule} v={plan.training.virtual_stages} "
      f"rc={[s.recompute for s in plan.stages][:3]} zero={[s.zero for s in plan.stages][:3]} engine={plan.engine} note={plan.engine_note[:150]!r} "
      f"step={plan.predicted.step_time_s:.3f} mfu={plan.predicted.mfu:.3f} mem={plan.predicted.peak_memory_gib:.1f} margin={getattr(plan.solver, 'margin', '-')} runner_up={getattr(plan.solver, 'runner_up', '-')}", flush=True)
if prof:
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
    s2 = io.StringIO()
    pstats.Stats(pr, stream=s2).sort_stats("tottime").print_stats(25)
    tag = sys.argv[3] if len(sys.argv) > 3 else "before"
    os.makedirs("prof", exist_ok=True)
    open(f"prof/{name}_{tag}.txt", "w").write(s.getvalue() + s2.getvalue())
