"""Two costs of running on gloo processes that share a host's cores, measured directly.

trace -> **cost** -> run. The numbers behind DECISIONS 73 and
results/costmodel_accuracy_cpu.md:

- ``sync``: what one synchronisation costs inside compute. Each of N processes runs the
  same matmuls (about 0.3 s), once straight and once split by K tiny all-reduces; the extra
  time per all-reduce is printed for several K, beside a bare all-reduce. With more
  processes than cores, ranks drift apart between synchronisation points and wait for the
  slowest at each.
- ``fsdp-memory``: the live tensor bytes (runtime/memory_probe.py) of two 4 MiB fp32
  layers before and after the forward under FSDP2's ``replicate``, and under
  ``fully_shard`` with and without resharding after the forward: the unsharded copy FSDP2
  gathers beside each parameter's shard (``RuntimeModel.fsdp_keeps_shards``).

    python benchmarks/gloo_costs.py [--procs 4] [sync|fsdp-memory ...]

Prints one line per measurement from rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SPLITS = (10, 40, 100)


def sync_cost() -> None:
    import torch
    import torch.distributed as dist

    a, b, tiny = torch.randn(256, 256), torch.randn(256, 256), torch.zeros(1)
    n = 400  # matmuls per process per run

    def run(k: int) -> float:
        times = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(max(k, 1)):
                for _ in range(n // max(k, 1)):
                    a @ b
                if k:
                    dist.all_reduce(tiny)
            dist.barrier()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    base = run(0)
    extra = {k: (run(k) - base) / k for k in SPLITS}
    dist.barrier()
    bare = []
    for _ in range(50):
        start = time.perf_counter()
        dist.all_reduce(tiny)
        bare.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        per = ", ".join(f"K={k}: {v * 1e3:.2f} ms" for k, v in extra.items())
        print(f"sync: {dist.get_world_size()} processes, {base * 1e3:.1f} ms of matmuls each; "
              f"extra per all-reduce inside compute {per}; bare all-reduce "
              f"{statistics.median(bare) * 1e3:.3f} ms", flush=True)


def fsdp_memory() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshplan.runtime.memory_probe import StepMemoryProbe

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for mode in ("replicate", "fully_shard(reshard_after_forward=False)",
                 "fully_shard(reshard_after_forward=True)"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 1024, bias=False),
                              nn.Linear(1024, 1024, bias=False))  # 4 MiB each
        for module in (*model, model):
            if mode == "replicate":
                replicate(module, mesh=mesh)
            else:
                fully_shard(module, mesh=mesh, reshard_after_forward=mode.endswith("True)"))
        x = torch.randn(8, 1024)
        model(x).sum().backward()  # warm-up: lazy initialisation
        for p in model.parameters():
            p.grad = None
        with StepMemoryProbe(list(model.parameters())) as probe:
            y = model(x)
            after_forward = probe.current_bytes
            y.sum().backward()
        if dist.get_rank() == 0:
            print(f"fsdp-memory: {mode}: live MiB before the forward "
                  f"{probe.start_bytes / 2**20:.1f}, after it {after_forward / 2**20:.1f}, "
                  f"peak {probe.peak_bytes / 2**20:.1f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="*", help="sync and/or fsdp-memory (default: both)")
    ap.add_argument("--procs", type=int, default=4)
    args = ap.parse_args()
    args.what = args.what or ["sync", "fsdp-memory"]
    for what in args.what:
        if what not in ("sync", "fsdp-memory"):
            ap.error(f"{what!r} is not something this measures; use sync or fsdp-memory")
    if "LOCAL_RANK" in os.environ:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        for what in args.what:
            (sync_cost if what == "sync" else fsdp_memory)()
        dist.destroy_process_group()
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.procs}",
           "--nnodes=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0",
           "--max_restarts=0", __file__, "--procs", str(args.procs), *args.what]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
