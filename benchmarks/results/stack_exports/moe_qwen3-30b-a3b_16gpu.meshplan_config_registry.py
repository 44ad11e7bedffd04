"""torchtitan 0.3.0 config written by meshplan: dp16 ep8 mb4 recompute full ZeRO-3 bf16 on 16 devices.

    torchrun --nproc_per_node ... -m torchtitan.train --module meshplan_job --config meshplan_qwen3_30b_a3b

The same job from torchtitan's own config and command-line overrides:

    --module qwen3 --config qwen3_30b_a3b --training.local_batch_size 4 --training.global_batch_size 64 --training.disable_cuda_graphs --parallelism.data_parallel_shard_degree 16 --parallelism.expert_parallel_degree 8

Everything else (data set, tokenizer, optimizer, steps, checkpoints) is qwen3_30b_a3b()'s; set
it here or on the command line."""

from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.models.qwen3.config_registry import qwen3_30b_a3b
from torchtitan.trainer import Trainer


def meshplan_qwen3_30b_a3b() -> Trainer.Config:
    config = qwen3_30b_a3b()
    config.training.local_batch_size = 4
    config.training.global_batch_size = 64
    config.training.seq_len = 4096
    config.training.dtype = 'float32'
    config.training.mixed_precision_param = 'bfloat16'
    config.training.mixed_precision_reduce = 'float32'
    config.training.disable_cuda_graphs = True
    config.parallelism.data_parallel_replicate_degree = 1
    config.parallelism.data_parallel_shard_degree = 16
    config.parallelism.fsdp_reshard_after_forward = 'default'
    config.parallelism.tensor_parallel_degree = 1
    config.parallelism.enable_sequence_parallel = True
    config.parallelism.context_parallel_degree = 1
    config.parallelism.context_parallel_load_balancer = 'headtail'
    config.parallelism.expert_parallel_degree = 8
    config.parallelism.pipeline_parallel_degree = 1
    config.parallelism.pipeline_parallel_schedule = '1F1B'
    config.parallelism.pipeline_parallel_microbatch_size = 1
    config.parallelism.module_fqns_per_model_part = None
    config.compile.enable = False
    config.compile.enable_async_tensor_parallel = False
    config.compile.components = ['model', 'loss']
    config.activation_checkpoint = FullAC.Config()
    return config
