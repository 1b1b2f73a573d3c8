"""``bf16``: bfloat16 on the wire; see :mod:`.fp16` for the rule (half(g / p), all-reduce).

Rule: send bf16(g_i / p); mean = float(sum_i bf16(g_i / p)). 2 bytes per element, fp32's
exponent range (no overflow concerns), 8 mantissa bits. Defaults: ``memory=false``.
"""

from easgd_lightning.hooks.compressors.fp16 import BF16Compressor

__all__ = ["BF16Compressor"]
