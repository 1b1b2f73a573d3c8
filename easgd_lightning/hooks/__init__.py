"""What travels on the wire: compressors, error-feedback memory, and their attach points.

* :func:`build_compressor` -- a compressor by config name (``conf/compression/<name>.yaml``).
* :mod:`.memory` -- :class:`ResidualMemory` / :class:`NoMemory` (error feedback).
* :func:`register_compression_hook` -- the DDP communication hook (every backend).
* :func:`exchange_sum` -- the (compressed) elastic-difference exchange;
  :func:`exchange_tensors` -- the exchange of a list of tensors through a collective.
"""

from easgd_lightning.hooks._exchange import exchange_tensors
from easgd_lightning.hooks.compressors import (
    COMPRESSORS,
    DEFAULT_MIN_NUMEL,
    Compressor,
    Payload,
    build_compressor,
    compressor_names,
    register_compressor,
)
from easgd_lightning.hooks.ddp import (
    CompressionHookState,
    DenseHookState,
    compressed_allreduce_hook,
    dense_allreduce_hook,
    register_compression_hook,
)
from easgd_lightning.hooks.elastic import exchange_sum
from easgd_lightning.hooks.memory import Memory, NoMemory, ResidualMemory, make_memory

__all__ = [
    "COMPRESSORS",
    "DEFAULT_MIN_NUMEL",
    "CompressionHookState",
    "Compressor",
    "DenseHookState",
    "Memory",
    "NoMemory",
    "Payload",
    "ResidualMemory",
    "build_compressor",
    "compressed_allreduce_hook",
    "compressor_names",
    "dense_allreduce_hook",
    "exchange_sum",
    "exchange_tensors",
    "make_memory",
    "register_compression_hook",
    "register_compressor",
]
