"""CUDA kernel time by class in one step of the one-GPU check (plan_h200_mb4.json through
meshplan.parallelize, eager and compile=True), to see which costs torch.compile removes.
Runs on the GPU machine from the repository root with meshplan importable (as
run_on_device.sh lays it out) and $OUT set; writes $OUT/kp.json (kept as
benchmarks/results/kernel_profile_h200.json). The source run on the H200, kept terse as it
was passed on one command line. Read by benchmarks/compile_check.py."""
import json,os,sys,time,torch
sys.path[:0]=["benchmarks/gpu","benchmarks"]
import model as M,meshplan,gpu_check as G,torch.distributed as dist
from torch.profiler import profile,ProfilerActivity as A
os.environ.update(MASTER_ADDR="127.0.0.1",MASTER_PORT="29533");dist.init_process_group("nccl",rank=0,world_size=1);torch.cuda.set_device(0)
def k(n):
 n=n.lower()
 for c,w in (("attn",("flash","fmha","cudnn","attention")),("opt",("adam","multi_tensor")),("mm",("gemm","cutlass","xmma","nvjet","cublas")),("triton",("triton",)),("red",("reduce","norm"))):
  if any(x in n for x in w):return c
 return "elt"
R=[]
for c in (False,True):
 with torch.device("meta"):net=M.gpu_llama()
 run=meshplan.parallelize(net,meshplan.Plan.from_json("benchmarks/gpu/plan_h200_mb4.json"),init_weights=M.init_weights,compile=c)
 o=torch.optim.AdamW(run.parameters(),lr=1e-4);D=[b.cuda() for b in G._batches(4,32000)]
 def s(i):run.train_step((i,));o.step();o.zero_grad()
 for i in D[:3]:s(i)
 torch.cuda.synchronize()
 with profile(activities=[A.CUDA]) as p:
  t=time.perf_counter();s(D[3]);torch.cuda.synchronize();w=time.perf_counter()-t
 by={}
 for e in p.key_averages():
  d=e.self_device_time_total/1e3
  if d<=0:continue
  b=by.setdefault(k(e.key),[0,0,[]]);b[0]+=d;b[1]+=e.count;b[2].append((round(d,2),e.count,e.key[:70]))
 for b in by.values():b[0]=round(b[0],2);b[2]=sorted(b[2])[::-1][:6]
 R.append(dict(compile=c,wall_ms=w*1e3,kernel_ms=sum(b[0] for b in by.values()),by=by));print(c,round(w*1e3,1),{x:(y[0],y[1]) for x,y in by.items()},flush=True)
 json.dump(R,open(os.environ["OUT"]+"/kp.json","w"),indent=1);del run,net,o;torch.cuda.empty_cache()
