"""Tensor parallelism over ``torch.distributed`` (chapter 10): the group, the parallel layers,
one rank's model shard. The runner that drives ``k`` ranks from the engine sits beside the
model runner it extends: ``course_pkg.engine.tensor_parallel_runner``."""
from course_pkg.distributed.group import (TensorParallelGroup, check_tensor_parallel_size, find_free_port,
                                          max_tensor_parallel_size)
from course_pkg.distributed.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                           VocabParallelEmbedding)
from course_pkg.distributed.model import build_shard_model, load_shard_model, parameter_bytes, shard_config

__all__ = [
    "ColumnParallelLinear", "ParallelLMHead", "RowParallelLinear", "TensorParallelGroup",
    "VocabParallelEmbedding", "build_shard_model", "check_tensor_parallel_size",
    "find_free_port", "load_shard_model", "max_tensor_parallel_size", "parameter_bytes", "shard_config",
]
