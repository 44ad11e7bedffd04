"""torchtitan 0.3.0 config written by meshplan: dp64 pp16 ep64 interleaved-1f1b x2 mb1 recompute selective ZeRO-3 bf16 on 1024 devices.

    torchrun --nproc_per_node ... -m torchtitan.train --module meshplan_job --config meshplan_deepseek_v3_671b

The same job from torchtitan's own config and command-line overrides:

    --module deepseek_v3 --config deepseek_v3_671b --training.local_batch_size 16 --training.global_batch_size 1024 --parallelism.data_parallel_shard_degree 64 --parallelism.fsdp_reshard_after_forward always --parallelism.expert_parallel_degree 64 --parallelism.pipeline_parallel_degree 16 --parallelism.module_fqns_per_model_part tok_embeddings,layers.0 layers.1 layers.2,layers.3 layers.4,layers.5 layers.6,layers.7 layers.8,layers.9 layers.10,layers.11 layers.12,layers.13 layers.14,layers.15 layers.16,layers.17 layers.18,layers.19 layers.20,layers.21 layers.22,layers.23 layers.24,layers.25 layers.26,layers.27 layers.28,layers.29 layers.30,layers.31 layers.32,layers.33 layers.34,layers.35 layers.36,layers.37 layers.38,layers.39 layers.40,layers.41 layers.42,layers.43 layers.44,layers.45 layers.46,layers.47 layers.48,layers.49 layers.50,layers.51 layers.52,layers.53 layers.54,layers.55 layers.56,layers.57 layers.58,layers.59 layers.60,norm,lm_head --compile.no_enable --compile.components model,loss

Everything else (data set, tokenizer, optimizer, steps, checkpoints) is deepseek_v3_671b()'s; set
it here or on the command line."""

from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_671b
from torchtitan.trainer import Trainer


def meshplan_deepseek_v3_671b() -> Trainer.Config:
    config = deepseek_v3_671b()
    config.training.local_batch_size = 16
    config.training.global_batch_size = 1024
    config.training.seq_len = 4096
    config.training.dtype = 'float32'
    config.training.mixed_precision_param = 'bfloat16'
    config.training.mixed_precision_reduce = 'float32'
    config.training.disable_cuda_graphs = True
    config.parallelism.data_parallel_replicate_degree = 1
    config.parallelism.data_parallel_shard_degree = 64
    config.parallelism.fsdp_reshard_after_forward = 'always'
    config.parallelism.tensor_parallel_degree = 1
    config.parallelism.enable_sequence_parallel = True
    config.parallelism.context_parallel_degree = 1
    config.parallelism.context_parallel_load_balancer = 'headtail'
    config.parallelism.expert_parallel_degree = 64
    config.parallelism.pipeline_parallel_degree = 16
    config.parallelism.pipeline_parallel_schedule = 'Interleaved1F1B'
    config.parallelism.pipeline_parallel_microbatch_size = 1
    config.parallelism.module_fqns_per_model_part = [['tok_embeddings', 'layers.0'], ['layers.1'], ['layers.2', 'layers.3'], ['layers.4', 'layers.5'], ['layers.6', 'layers.7'], ['layers.8', 'layers.9'], ['layers.10', 'layers.11'], ['layers.12', 'layers.13'], ['layers.14', 'layers.15'], ['layers.16', 'layers.17'], ['layers.18', 'layers.19'], ['layers.20', 'layers.21'], ['layers.22', 'layers.23'], ['layers.24', 'layers.25'], ['layers.26', 'layers.27'], ['layers.28', 'layers.29'], ['layers.30', 'layers.31'], ['layers.32', 'layers.33'], ['layers.34', 'layers.35'], ['layers.36', 'layers.37'], ['layers.38', 'layers.39'], ['layers.40', 'layers.41'], ['layers.42', 'layers.43'], ['layers.44', 'layers.45'], ['layers.46', 'layers.47'], ['layers.48', 'layers.49'], ['layers.50', 'layers.51'], ['layers.52', 'layers.53'], ['layers.54', 'layers.55'], ['layers.56', 'layers.57'], ['layers.58', 'layers.59'], ['layers.60', 'norm', 'lm_head']]
    config.compile.enable = False
    config.compile.enable_async_tensor_parallel = False
    config.compile.components = ['model', 'loss']
    config.activation_checkpoint = SelectiveAC.Config()
    return config
