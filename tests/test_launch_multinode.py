"""``meshplan run`` on many nodes, on a token file, with warmup, clipping, resume and Ctrl-C.

* Two "nodes" of 2 processes on localhost (two ``meshplan run --nnodes 2 --node-rank 0/1``
  processes meeting at one c10d rendezvous) train a 4-device dp2 x pp2 plan with the same
  losses, learning rates and gradient norms as one process (one 4-process launch of
  ``meshplan run`` is the CLI tests' and the demo's).
  Both read a nanoGPT-style uint16 token file (``--data``), warm up (``--warmup``) and
  clip (``--clip``). The one process trains steps 1-2 with a checkpoint directory and is
  resumed from it for step 3.
* ``runtime/grad_clip.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` in one
  process, for dp, tp, ZeRO-2 and pp plans (GPT-2 ties its embedding and output head, which
  pp puts on different stages): one torchrun launch of 2 processes. Run as a script under
  torchrun, this file is that worker.
* SIGINT to ``meshplan run`` ends every rank within seconds, with one line.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

MODEL = "transformers:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256&n_positions=64"
BATCH, SEQ, SEED, MAX_NORM = 8, 16, 0, 0.5
TRAIN = ["--steps", "3", "--lr", "1e-2", "--warmup", "3", "--clip", str(MAX_NORM)]
CLIP_PLANS = {"dp": dict(dp=2, microbatch_size=4), "tp": dict(tp=2, microbatch_size=8),
              "zero2": dict(dp=2, microbatch_size=4, zero=2), "pp": dict(pp=2, microbatch_size=2)}


def write_plan(path, devices: int, **manual) -> str:
    from meshplan.api import manual_plan
    from meshplan.mesh import Mesh
    from meshplan.specs import example_inputs, parse_model_spec

    meta = parse_model_spec(MODEL).build(device="meta")
    manual_plan(meta, Mesh.local(devices), example_inputs(meta, BATCH, SEQ), **manual).to_json(path)
    return str(path)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshplan.cli", "run", *args]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def run_cli(*args: str, timeout: int = 600) -> None:
    proc = subprocess.run(cli(*args), env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


# -- many nodes, real data -------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from meshplan.runtime.launch import free_port

    tmp = tmp_path_factory.mktemp("multinode")
    tokens = tmp / "train.bin"  # nanoGPT's format: np.array(ids, np.uint16).tofile(...)
    np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16).tofile(tokens)
    p4 = write_plan(tmp / "p4.json", 4, dp=2, pp=2)
    p1 = write_plan(tmp / "p1.json", 1, microbatch_size=BATCH)
    data = ["--model", MODEL, "--data", str(tokens), *TRAIN]
    port = free_port()
    nodes = [subprocess.Popen(cli(p4, *data, "--nnodes", "2", "--node-rank", str(r),
                                  "--rdzv-endpoint", f"127.0.0.1:{port}",
                                  "--metrics-out", str(tmp / "nodes.json")),
                              env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for r in (0, 1)]
    for node in nodes:
        out, _ = node.communicate(timeout=600)
        assert node.returncode == 0, out[-4000:]
    # one process: steps 1-2 of the same training, checkpointed, then step 3 resumed from it
    ckpt = ["--checkpoint-dir", str(tmp / "ckpt")]
    run_cli(p1, *data[:-len(TRAIN)], *TRAIN[2:], "--steps", "2", *ckpt,
            "--metrics-out", str(tmp / "first.json"))
    run_cli(p1, *data, *ckpt, "--metrics-out", str(tmp / "resumed.json"))
    return {name: json.loads((tmp / f"{name}.json").read_text())
            for name in ("nodes", "first", "resumed")}


def test_two_nodes_match_one_process(runs):
    nodes, first = runs["nodes"], runs["first"]
    assert nodes["world_size"] == 4 and first["world_size"] == 1 and first["first_step"] == 0
    for key in ("losses", "grad_norm"):  # steps 1-2; step 3 (resumed) below
        torch.testing.assert_close(torch.tensor(nodes[key][:2]), torch.tensor(first[key]),
                                   rtol=1e-5, atol=0)
    assert nodes["lr"] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2])  # linear warmup over 3
    assert first["lr"] == pytest.approx(nodes["lr"][:2])
    assert all(n > MAX_NORM for n in nodes["grad_norm"])  # clipping was active
    assert nodes["data"].endswith("train.bin") and len(nodes["step_time_s"]) == 3


def test_second_run_resumes_from_the_checkpoint_dir(runs):
    """The resumed process's step 3 is the two nodes' step 3 (the same training, so the
    same loss, gradient norm and learning rate): weights, optimizer state, the schedule
    and the data position all came back from the checkpoint."""
    resumed, nodes = runs["resumed"], runs["nodes"]
    assert resumed["first_step"] == 2 and resumed["world_size"] == 1
    for key in ("losses", "grad_norm"):
        torch.testing.assert_close(torch.tensor(resumed[key]), torch.tensor(nodes[key][2:]),
                                   rtol=1e-5, atol=0)
    assert resumed["lr"] == pytest.approx(nodes["lr"][2:])  # the schedule resumes too


def test_token_windows_depend_on_seed_and_step_only(tmp_path):
    from meshplan.runtime.data import TokenFile

    path = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint32).tofile(path)
    tokens = TokenFile(str(path), "uint32")
    full = tokens.batch(4, 8, seed=1, step=3)
    assert torch.equal(full[:, 1:] - full[:, :-1], torch.ones(4, 7, dtype=torch.int64))
    part = tokens.batch(4, 8, seed=1, step=3, rows=[1, 3])
    assert torch.equal(part[[1, 3]], full[[1, 3]]) and not part[[0, 2]].any()
    assert not torch.equal(tokens.batch(4, 8, seed=1, step=4), full)


# -- gradient clipping against torch.nn.utils ---------------------------------------------------

def clip_worker(out: str) -> None:
    """Every plan in ``out``'s folder: one step with the clip as an optimizer pre-hook."""
    import torch.distributed as dist

    from meshplan.plan import Plan
    from meshplan.runtime.grad_clip import clip_grad_norm_, total_norm
    from meshplan.runtime.graph.parallelize import make_optimizer, parallelize_graph
    from meshplan.specs import parse_model_spec, synthetic_batch

    dist.init_process_group("gloo")
    results = {}
    folder = os.path.dirname(out)
    for path in sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".json")):
        plan = Plan.from_json(path)
        torch.manual_seed(SEED)
        model = parse_model_spec(MODEL).build(device="cpu")
        batch = synthetic_batch(model, BATCH, SEQ, seed=SEED, step=0)
        pm = parallelize_graph(model, plan, (batch,))
        opt = make_optimizer(pm.optimizer_params(), plan)
        rec = {}

        def clip(*_):
            rec["inf"] = total_norm(pm, math.inf)
            rec["norm"] = clip_grad_norm_(pm, MAX_NORM)
            rec["grads"] = pm.full_grads() if hasattr(pm, "full_grads") else {
                n: p.grad.full_tensor() for n, p in pm.optimizer_params().items()
                if p.grad is not None}
        opt.register_step_pre_hook(clip)
        pm.train_step(batch, opt)
        results[os.path.basename(path)] = rec
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def clipped(tmp_path_factory):
    from tests._launch import forked_results

    tmp = tmp_path_factory.mktemp("clip")
    for name, kw in CLIP_PLANS.items():
        write_plan(tmp / f"{name}.json", 2, **kw)
    return forked_results(__file__, tmp / "out.pt", nproc=2)


@pytest.fixture(scope="module")
def reference():
    from meshplan.tracing import TrainingModule
    from meshplan.specs import parse_model_spec, synthetic_batch

    torch.manual_seed(SEED)
    model = parse_model_spec(MODEL).build(device="cpu")
    TrainingModule(model)(synthetic_batch(model, BATCH, SEQ, seed=SEED, step=0)).backward()
    inf = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], math.inf)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return float(norm), float(inf), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", list(CLIP_PLANS))
def test_clip_grad_norm_matches_one_process(clipped, reference, variant):
    got = clipped[f"{variant}.json"]
    norm, inf, grads = reference
    assert norm > MAX_NORM
    torch.testing.assert_close(got["norm"], norm, rtol=1e-5, atol=0)
    torch.testing.assert_close(got["inf"], inf, rtol=1e-5, atol=0)
    assert set(grads) <= set(got["grads"])
    for name, grad in grads.items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")


# -- Ctrl-C --------------------------------------------------------------------------------------

def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(k) for k in out.split()]
    return kids + [g for k in kids for g in _descendants(k)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_ends_every_rank_with_one_line(tmp_path):
    plan = write_plan(tmp_path / "p2.json", 2, dp=2, microbatch_size=4)
    proc = subprocess.Popen(cli(plan, "--model", MODEL, "--steps", "100000"), env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        before = []
        for line in proc.stdout:  # rank 0 prints one line per step
            before.append(line)
            if line.startswith("step 0:"):
                break
        assert before and before[-1].startswith("step 0:"), "".join(before)[-3000:]
        workers = _descendants(proc.pid)
        assert len(workers) >= 2
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        after = proc.stdout.read()  # everything until the launcher exits
        proc.wait(timeout=30)
        elapsed_s = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert elapsed_s < 10
    lines = [line for line in after.splitlines() if not line.startswith("step ")]
    assert lines == ["meshplan run: interrupted"], after[-3000:]
    assert not [pid for pid in workers if _alive(pid)]


if __name__ == "__main__":  # torchrun worker: OUT (the plans are beside it)
    clip_worker(sys.argv[1])
