"""torchtitan 0.3.0 config written by meshplan: dp4 tp2 mb1 recompute none SP ZeRO-3 bf16 on 8 devices.

    torchrun --nproc_per_node ... -m torchtitan.train --module meshplan_job --config meshplan_llama3_8b

The same job from torchtitan's own config and command-line overrides:

    --module llama3 --config llama3_8b --training.global_batch_size 16 --parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 2 activation-checkpoint:none

Everything else (data set, tokenizer, optimizer, steps, checkpoints) is llama3_8b()'s; set
it here or on the command line."""

from torchtitan.models.llama3.config_registry import llama3_8b
from torchtitan.trainer import Trainer


def meshplan_llama3_8b() -> Trainer.Config:
    config = llama3_8b()
    config.training.local_batch_size = 1
    config.training.global_batch_size = 16
    config.training.seq_len = 8192
    config.training.dtype = 'float32'
    config.training.mixed_precision_param = 'bfloat16'
    config.training.mixed_precision_reduce = 'float32'
    config.parallelism.data_parallel_replicate_degree = 1
    config.parallelism.data_parallel_shard_degree = 4
    config.parallelism.fsdp_reshard_after_forward = 'default'
    config.parallelism.tensor_parallel_degree = 2
    config.parallelism.enable_sequence_parallel = True
    config.parallelism.context_parallel_degree = 1
    config.parallelism.context_parallel_load_balancer = 'headtail'
    config.parallelism.expert_parallel_degree = 1
    config.parallelism.pipeline_parallel_degree = 1
    config.parallelism.pipeline_parallel_schedule = '1F1B'
    config.parallelism.pipeline_parallel_microbatch_size = 1
    config.parallelism.module_fqns_per_model_part = None
    config.compile.enable = False
    config.compile.enable_async_tensor_parallel = False
    config.compile.components = ['model', 'loss']
    config.activation_checkpoint = None
    return config
