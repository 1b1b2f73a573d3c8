"""3D parallelism building blocks: tensor-parallel layers, layout checks, the pipeline engine.

``engine`` imports DeepSpeed and is imported on demand (``easgd_lightning.parallel.engine``).
"""

from easgd_lightning.parallel.layout import Layout, validate_layout
from easgd_lightning.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelContext,
    VocabParallelEmbedding,
)

__all__ = [
    "Layout",
    "validate_layout",
    "TensorParallelContext",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
]
