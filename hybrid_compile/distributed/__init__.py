"""Tensor parallelism: one model served by N processes, one per device, on torch.distributed.

- ``group.py``: the process group (NCCL on CUDA, gloo on CPU), the traced functional collectives
  and the error channel;
- ``plans.py``: per-family sharding plans (which heads / channels / rows each rank holds);
- ``loading.py``: each rank reads only its slices of the safetensors files (the model's, and with
  speculative method "mtp" its MTP head's ``mtp.*`` tensors, by the same plan);
- ``layers.py``: the all-reduces and the vocab-parallel embedding / LM head in a rank's model;
- ``step.py``: rank 0 broadcasts every step (packed metadata), the other ranks run it (the MTP
  head's forwards of a proposal too);
- ``runtime.py``: launching (spawned processes or torchrun), rank 0's engine, shutdown.

Entry point: ``hybrid_compile.from_pretrained(dir, tensor_parallel_size=N)``.
"""

from .group import TensorParallelError, TensorParallelGroup
from .plans import ShardingError, plan_for
from .runtime import TensorParallelEngine, launch

__all__ = ["ShardingError", "TensorParallelEngine", "TensorParallelError", "TensorParallelGroup", "launch", "plan_for"]
