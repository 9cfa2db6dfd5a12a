"""safetensors' dtype names: the one table the checkpoint reader and the streaming writer share. (The weight readers the
custom-tier bundle copies alone, targets.bundle.WEIGHT_READERS, import torch only and keep their own one-line lookups.)"""
from __future__ import annotations

import torch

ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64, "I64": torch.int64,
             "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
             "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DTYPE_NAMES = {v: k for k, v in ST_DTYPES.items()}
