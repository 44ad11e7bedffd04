"""Worker for tests/test_stacks_torchtitan.py: torchtitan 0.2.2's own code on an exported job.

    python tests/_torchtitan_check.py MODE JOB.toml WORLD [JOB.toml WORLD ...]

MODE ``mesh``: ``ConfigManager().parse_args(["--job.config_file", JOB])``, ``ParallelDims``
(its validation) and ``ParallelDims.build_mesh`` on torch's fake process group of WORLD ranks
(this process is rank 0), then the meshes' sizes checked by torchtitan's
``_validate_meshes``. Prints one JSON line with the parsed config and the resolved degrees.
MODE ``flavors`` (JOB and WORLD unused): each dense llama3 / qwen3 flavor built on the meta
device by torchtitan's own model classes, its dimensions read off the weights, and
torchtitan's default pipeline split (``generate_llm_fqn_per_model_part``) for a grid of
stage counts. MODE ``init``: also builds torchtitan's ``Trainer`` (model on meta, pipeline split,
TP / CP / activation checkpointing / FSDP, weights, optimizer) with ``comm.mode =
"fake_backend"``; ``steps``: and runs two training steps (``Trainer.train_step``).

torchtitan 0.2.2 picks "cuda" when no accelerator is found (tools/utils.py) and imports
triton through its package ``__init__`` (float8 -> MoE kernels); this worker runs on the CPU
(torch's device-type probe answers "cpu"), loads only the config and parallel-dims modules
when triton is absent (``mesh``), and replaces what torchtitan reads from the device or
the data set: the tokenizer (none: the default flavors use causal SDPA, no document mask),
the data loader (random tokens), the device memory monitor (torch.cpu keeps no statistics).
"""

import dataclasses
import importlib.util
import json
import os
import sys
import types

import torch
import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"


def _load_torchtitan(full: bool):
    if "torchtitan" in sys.modules:
        return
    if full or importlib.util.find_spec("triton") is not None:
        import torchtitan  # noqa: F401
        return
    spec = importlib.util.find_spec("torchtitan")
    pkg = types.ModuleType("torchtitan")  # its __init__ only imports float8 (-> triton)
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    sys.modules["torchtitan"] = pkg


def main(mode: str, path: str, world: int) -> None:
    os.environ.update(NGPU=str(world), LOCAL_RANK="0", RANK="0", WORLD_SIZE=str(world))
    _load_torchtitan(full=mode != "mesh")
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims

    cfg = ConfigManager().parse_args(["--job.config_file", path, "--comm.mode", "fake_backend",
                                      "--training.steps", "2", "--job.dump_folder",
                                      os.environ.get("TT_DUMP", "/tmp/tt_dump")])
    p = cfg.parallelism
    dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree,
                        dp_shard=p.data_parallel_shard_degree, cp=p.context_parallel_degree,
                        tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree,
                        world_size=world)
    out = {"config": cfg.to_dict(), "dp_shard": dims.dp_shard,
           "seq_len_divisor": dims.seq_len_divisor, "fsdp_enabled": dims.fsdp_enabled}
    if mode == "mesh":
        torch.distributed.init_process_group("fake", rank=0, world_size=world)
        dims.build_mesh()  # asserts every mesh's size (_validate_meshes)
        out["meshes"] = {k: v.size() for k, v in dims.get_all_one_dimensional_meshes().items()}
        torch.distributed.destroy_process_group()
    else:
        out.update(_trainer(cfg, steps=2 if mode == "steps" else 0))
    print("RESULT " + json.dumps(out, default=str))


def _trainer(cfg, steps: int) -> dict:
    import torchtitan.components.metrics as metrics
    import torchtitan.train as train
    from torchtitan.protocols import train_spec

    spec = train_spec.get_train_spec(cfg.model.name)
    vocab = spec.model_args[cfg.model.flavor].vocab_size

    def random_tokens(dp_world_size, dp_rank, tokenizer, job_config, **_):
        gen = torch.Generator().manual_seed(dp_rank)
        shape = (job_config.training.local_batch_size, job_config.training.seq_len + 1)
        while True:
            x = torch.randint(vocab, shape, generator=gen)
            yield {"input": x[:, :-1]}, x[:, 1:]

    class CpuMemoryMonitor:  # torch.cpu keeps no memory statistics
        device_name, device_capacity, device_capacity_gib = "cpu", 1, 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self):
            pass

    metrics.build_device_memory_monitor = CpuMemoryMonitor
    train_spec._extra_train_specs[cfg.model.name] = dataclasses.replace(
        spec, build_tokenizer_fn=None, build_dataloader_fn=random_tokens)
    trainer = train.Trainer(cfg)
    batches = trainer.batch_generator(trainer.dataloader)
    for _ in range(steps):  # Trainer.train's loop, less its post-step barrier (needs a GPU id)
        trainer.step += 1
        trainer.train_step(batches)
    return {"steps": trainer.step, "model_parts": len(trainer.model_parts),
            "params": sum(p.numel() for m in trainer.model_parts for p in m.parameters()),
            "grad_accumulation": trainer.gradient_accumulation_steps}


def flavors() -> None:
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part
    from torchtitan.protocols import train_spec

    dims = {}
    for name in ("llama3", "qwen3"):
        spec = train_spec.get_train_spec(name)
        for flavor, args in spec.model_args.items():
            if getattr(args, "moe_enabled", False) or getattr(args, "attn_type", "sdpa") != "sdpa":
                continue
            with torch.device("meta"):
                model = spec.model_cls(args)
            block = model.layers["0"]
            att = block.attention
            dims[f"{name}/{flavor}"] = dict(
                hidden=model.tok_embeddings.weight.shape[1],
                vocab=model.tok_embeddings.weight.shape[0],
                layers=len(model.layers), ffn_hidden=block.feed_forward.w1.weight.shape[0],
                head_dim=att.head_dim, heads=att.wq.weight.shape[0] // att.head_dim,
                kv_heads=att.wk.weight.shape[0] // att.head_dim,
                rope_theta=float(args.rope_theta), norm_eps=float(args.norm_eps),
                max_positions=args.max_seq_len,
                tied_embeddings=bool(getattr(args, "enable_weight_tying", False)))
    splits = {}
    for stages in (2, 3, 4, 8, 16):
        for layers, first, last in ((32, 1, 1), (126, 1, 1), (80, 2, 3), (6, 1, 1)):
            try:
                parts = generate_llm_fqn_per_model_part(stages, layers, first, last)
            except ValueError:
                continue
            counts = [sum(m.startswith("layers.") for m in part) for part in parts]
            splits[f"{stages},{layers},{first},{last}"] = counts
    print("RESULT " + json.dumps({"flavors": dims, "splits": splits}))


if __name__ == "__main__":
    if sys.argv[1] == "flavors":
        _load_torchtitan(full=True)
        flavors()
        sys.exit()
    mode, pairs = sys.argv[1], sys.argv[2:]
    assert mode == "mesh" or len(pairs) == 2, "one Trainer per process"
    for i in range(0, len(pairs), 2):
        main(mode, pairs[i], int(pairs[i + 1]))
