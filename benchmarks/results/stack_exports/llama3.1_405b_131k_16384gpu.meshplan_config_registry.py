"""torchtitan 0.3.0 config written by meshplan: dp256 tp4 cp16 mb1 recompute selective SP ZeRO-3 bf16 compiled on 16384 devices.

    torchrun --nproc_per_node ... -m torchtitan.train --module meshplan_job --config meshplan_llama3_405b

No override line for torchtitan's own config:

    (none: llama3_405b() converts the model to float8 rowwise in its model spec, which torchtitan's command line cannot change; use --module meshplan_job --config meshplan_llama3_405b)

Everything else (data set, tokenizer, optimizer, steps, checkpoints) is llama3_405b()'s; set
it here or on the command line."""

from torchtitan.components.optimizer import default_adamw
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_70b
from torchtitan.trainer import Trainer


def meshplan_llama3_405b() -> Trainer.Config:
    config = llama3_70b()  # llama3_405b() but its float8 rowwise converter (the plan is not fp8)
    config.model_spec = model_registry('405B')
    config.hf_assets_path = './assets/hf/Llama-3.1-405B'
    config.optimizer = default_adamw(lr=8e-5)
    config.lr_scheduler.warmup_steps = 600
    config.training.steps = 3000
    config.training.local_batch_size = 1
    config.training.global_batch_size = 512
    config.training.seq_len = 131072
    config.training.dtype = 'float32'
    config.training.mixed_precision_param = 'bfloat16'
    config.training.mixed_precision_reduce = 'float32'
    config.parallelism.data_parallel_replicate_degree = 1
    config.parallelism.data_parallel_shard_degree = 256
    config.parallelism.fsdp_reshard_after_forward = 'default'
    config.parallelism.tensor_parallel_degree = 4
    config.parallelism.enable_sequence_parallel = True
    config.parallelism.context_parallel_degree = 16
    config.parallelism.context_parallel_load_balancer = 'headtail'
    config.parallelism.expert_parallel_degree = 1
    config.parallelism.pipeline_parallel_degree = 1
    config.parallelism.pipeline_parallel_schedule = '1F1B'
    config.parallelism.pipeline_parallel_microbatch_size = 1
    config.parallelism.module_fqns_per_model_part = None
    config.compile.enable = True
    config.compile.enable_async_tensor_parallel = False
    config.compile.components = ['model', 'loss']
    config.activation_checkpoint = SelectiveAC.Config()
    return config
