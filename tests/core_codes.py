"""The core's dtype and reduction op codes by name (csrc/hvdmx/base/common.h),
as hvdmx._core exports them: the one list the single-process tests read."""
import hvdmx

DTYPE_CODES = hvdmx._core.DTYPE_CODES  # {"float32": 0, ..., "bfloat16": 12}
REDUCE_OPS = hvdmx._core.REDUCE_OPS  # {"Average": 0, "Sum": 1, ...}
