"""Worker for tests/test_stacks_torchtitan.py: torchtitan 0.3.0's own code on exported configs.

    python tests/_torchtitan_check.py MODE JOBS.json

JOBS.json lists jobs ``{"package": P, "function": F, "world": N, "command": LINE}``; each
package lies beside JOBS.json (put on ``sys.path``). MODE ``mesh``: for each job,
``ConfigManager().parse_args(["--module", P, "--config", F])`` (the Python form), and when
``command`` is a ``--module llama3 --config llama3_70b ...`` line, ConfigManager on it too,
the two parsed configs compared section by section; then ``ParallelDims.from_config`` (its
validation) and ``ParallelDims.build_mesh`` on torch's fake process group of N ranks (this
process is rank 0; ``_validate_meshes`` checks each mesh's size). Prints one JSON line per job
with the parsed sections and the meshes. MODE ``steps``: for each job in turn (the process group destroyed between them), torchtitan's ``Trainer``
built with ``comm.mode = "fake_backend"`` (model on meta, TP / AC / FSDP, weights,
optimizer), then ``job["steps"]`` (default 2) ``Trainer.train_step`` calls. MODE ``flavors`` (JOBS unused): the dense
flavors' dimensions read off torchtitan's models built on meta, and its default pipeline split
(``_generate_llm_fqn_per_model_part``) for a grid of stage counts.

torchtitan 0.3 picks "cuda" when no accelerator is found (tools/utils.py): the worker makes
torch's device-type probe answer "cpu" before torchtitan is imported, and replaces what the
Trainer reads from a device or a data set: the tokenizer (none), the data loader (random
tokens), the device memory monitor (torch.cpu keeps no statistics).
"""

import dataclasses
import json
import os
import sys

import torch
import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"

SECTIONS = ("training", "parallelism", "compile")


def _parse(args: list[str], dump: str):
    from torchtitan.config import ConfigManager

    # before the words given: an activation-checkpoint:NAME subcommand ends tyro's options
    return ConfigManager().parse_args(["--comm.mode", "fake_backend", "--training.steps", "2",
                                       "--dump_folder", dump] + args)


def _summary(cfg) -> dict:
    ac = cfg.activation_checkpoint
    out = {s: dataclasses.asdict(getattr(cfg, s)) for s in SECTIONS}
    out["activation_checkpoint"] = None if ac is None else type(ac).__qualname__
    out["flavor"] = [cfg.model_spec.name, cfg.model_spec.flavor]
    return out


def mesh(jobs: list[dict], dump: str) -> None:
    from torchtitan.distributed.parallel_dims import ParallelDims

    for job in jobs:
        cfg = _parse(["--module", job["package"], "--config", job["function"]], dump)
        out = _summary(cfg)
        if job.get("command", "").startswith("--module"):
            import shlex

            other = _summary(_parse(shlex.split(job["command"]), dump))
            out["command_differs"] = {k: [out[k], other[k]] for k in out if out[k] != other[k]}
        dims = ParallelDims.from_config(cfg.parallelism, job["world"])
        torch.distributed.init_process_group("fake", rank=0, world_size=job["world"])
        dims.build_mesh()  # asserts every mesh's size (_validate_meshes)
        out["meshes"] = {k: v.size() for k, v in dims.get_all_one_dimensional_meshes().items()}
        out.update(dp_shard=dims.dp_shard, seq_len_divisor=dims.seq_len_divisor,
                   fsdp_enabled=dims.fsdp_enabled)
        torch.distributed.destroy_process_group()
        print("RESULT " + json.dumps(out, default=str), flush=True)


def steps(job: dict, dump: str) -> None:
    import torchtitan.components.metrics as metrics
    import torchtitan.trainer as trainer_mod

    os.environ.update(NGPU=str(job["world"]), LOCAL_RANK="0", RANK="0",
                      WORLD_SIZE=str(job["world"]), LOCAL_WORLD_SIZE=str(job["world"]))
    cfg = _parse(["--module", job["package"], "--config", job["function"],
                  "--checkpoint.no_enable", "--training.disable_cuda_graphs",
                  "--metrics.no_enable_tensorboard", "--profiler.no_enable_profiling",
                  "--validator.no_enable"] + job.get("extra", []), dump)
    vocab = cfg.model_spec.model.vocab_size
    seq = cfg.training.seq_len

    class RandomTokens:  # the data loader: random tokens, one generator per dp rank
        def __init__(self, dp_rank, local_batch_size, **_):
            self.gen = torch.Generator().manual_seed(dp_rank)
            self.shape = (local_batch_size, seq + 1)

        def __iter__(self):
            while True:
                x = torch.randint(vocab, self.shape, generator=self.gen)
                # positions: one document a row (FlexAttention's mask is built from them)
                pos = torch.arange(seq).expand(self.shape[0], seq)
                yield {"input": x[:, :-1], "positions": pos}, x[:, 1:]

        def state_dict(self):
            return {}

    class Loader:
        def build(self, **kw):
            return RandomTokens(**kw)

    class NoTokenizer:
        def build(self, **_):
            return None

    class CpuMemoryMonitor:  # torch.cpu keeps no memory statistics
        device_name, device_capacity, device_capacity_gib = "cpu", 1, 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self):
            pass

    metrics.build_device_memory_monitor = CpuMemoryMonitor
    cfg.dataloader, cfg.tokenizer = Loader(), NoTokenizer()
    trainer = trainer_mod.Trainer(cfg)
    batches = trainer.batch_generator(trainer.dataloader)
    for _ in range(job.get("steps", 2)):  # Trainer.train's loop body, less its barrier
        trainer.step += 1
        trainer.train_step(batches)
    print("RESULT " + json.dumps({
        "steps": trainer.step, "model_parts": len(trainer.model_parts),
        "params": sum(p.numel() for m in trainer.model_parts for p in m.parameters()),
        "grad_accumulation": trainer.gradient_accumulation_steps}), flush=True)


def flavors() -> None:
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.qwen3 import qwen3_configs

    dims = {}
    for name, table in (("llama3", llama3_configs), ("qwen3", qwen3_configs)):
        for flavor, build in table.items():
            cfg = build(attn_backend="flex")
            if getattr(cfg.layers[0], "moe", None) is not None or "moe" in flavor \
                    or "non_fused" in flavor or "-A" in flavor:
                continue
            with torch.device("meta"):
                model = cfg.build()
            block = next(iter(model.layers.values()))
            att = block.attention
            emb = model.tok_embeddings.weight
            qkv = [v for k, v in att.named_parameters() if k.endswith(("wq.weight",
                                                                       "wqkv.weight"))][0]
            rope = cfg.layers[0].attention.rope
            dims[f"{name}/{flavor}"] = dict(
                hidden=emb.shape[1], vocab=emb.shape[0], layers=len(model.layers),
                ffn_hidden=block.feed_forward.w1.weight.shape[0], head_dim=att.head_dim,
                heads=att.n_heads, kv_heads=att.n_kv_heads, rope_theta=float(rope.theta),
                tied_embeddings=bool(cfg.enable_weight_tying), wq_rows=qkv.shape[0])
    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    moe = {}  # the mixtures of experts, read off their configs (nothing built)
    for name, table, names in (("qwen3", qwen3_configs, ("debugmodel_moe", "30B-A3B",
                                                          "235B-A22B")),
                               ("deepseek_v3", deepseekv3_configs, ("671B",))):
        for flavor in names:
            kw = {"moe_comm_backend": "standard"} if name == "deepseek_v3" else {}
            cfg = table[flavor](attn_backend="flex", **kw)
            last, att = cfg.layers[-1], cfg.layers[-1].attention
            qkv = getattr(att, "qkv_linear", None)
            router, shared = last.moe.router, last.moe.shared_experts
            dense = [i for i, b in enumerate(cfg.layers) if getattr(b, "moe", None) is None]
            ff = cfg.layers[0].feed_forward if dense else None
            moe[f"{name}/{flavor}"] = dict(
                hidden=cfg.dim, vocab=cfg.vocab_size, layers=len(cfg.layers),
                heads=att.n_heads, kv_heads=qkv.n_kv_heads if qkv else att.n_heads,
                head_dim=qkv.head_dim if qkv else att.qk_nope_head_dim,
                rope_theta=float(att.rope.theta), norm_eps=cfg.layers[0].attention_norm.eps,
                tied_embeddings=bool(getattr(cfg, "enable_weight_tying", False)),
                experts=last.moe.num_experts, top_k=router.top_k,
                moe_ffn_hidden=last.moe.routed_experts.inner_experts.hidden_dim,
                shared_ffn_hidden=shared.w1.out_features if shared else 0,
                dense_layers=dense, ffn_hidden=ff.w1.out_features if ff else None,
                q_lora_rank=getattr(att, "q_lora_rank", 0),
                kv_lora_rank=getattr(att, "kv_lora_rank", 0),
                qk_rope_dim=getattr(att, "qk_rope_head_dim", 0),
                v_head_dim=getattr(att, "v_head_dim", 0), score=router.score_func,
                norm_topk=router.route_norm, router_scale=router.route_scale,
                router_groups=router.num_expert_groups or 1,
                router_group_topk=router.num_limited_groups or 1)
    splits = {}
    for stages in (2, 3, 4, 8, 16):
        for layers, first, last in ((32, 1, 1), (126, 1, 1), (80, 2, 3), (6, 1, 1)):
            try:
                parts = _generate_llm_fqn_per_model_part(stages, layers, first, last)
            except ValueError:
                continue
            splits[f"{stages},{layers},{first},{last}"] = [
                sum(m.startswith("layers.") for m in part) for part in parts]
    print("RESULT " + json.dumps({"flavors": dims, "moe": moe, "splits": splits},
                                 default=str))


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "flavors":
        flavors()
        sys.exit()
    path = sys.argv[2]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    with open(path) as f:
        jobs = json.load(f)
    dump = os.environ.get("TT_DUMP", "/tmp/tt_dump")
    if mode == "mesh":
        mesh(jobs, dump)
    else:
        assert mode == "steps", mode
        for job in jobs:  # one Trainer after another (torchtitan's imports paid once)
            steps(job, dump)
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
