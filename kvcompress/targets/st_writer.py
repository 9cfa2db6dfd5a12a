"""A safetensors writer for tensors that arrive one at a time (streaming export).

The header is written first, from a plan {name: (dtype, shape)} known in advance (the export
derives it from the model's meta tensors); each tensor (or a block of its rows) is then written at
its offset as it is produced, so the writer never holds more than what it is given. The file is
written under a temporary name and renamed on `close()` only if every byte of every planned tensor
was written; on error the temporary file is removed. The result is an ordinary safetensors file
(`safetensors.safe_open` reads it; a test checks against `safetensors.torch.save_file`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kvcompress.models.st_dtypes import DTYPE_NAMES


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of this dtype and shape."""
    n = dtype.itemsize
    for s in shape:
        n *= int(s)
    return n


class SafetensorsWriter:
    def __init__(self, path: str | Path, plan: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.plan = {k: (dt, tuple(int(s) for s in shape)) for k, (dt, shape) in plan.items()}
        header, off = {}, 0
        self.offsets: dict[str, int] = {}
        for k in sorted(self.plan):
            dt, shape = self.plan[k]
            n = nbytes(dt, shape)
            header[k] = {"dtype": DTYPE_NAMES[dt], "shape": list(shape), "data_offsets": [off, off + n]}
            self.offsets[k] = off
            off += n
        if metadata:
            header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((-len(raw)) % 8)  # data starts 8-byte aligned
        self.data_start = 8 + len(raw)
        self.size = off
        self.written = dict.fromkeys(self.plan, 0)  # bytes written per tensor
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.f = open(self.tmp, "wb")
        self.f.write(len(raw).to_bytes(8, "little") + raw)
        self.f.truncate(self.data_start + self.size)

    def write(self, name: str, t: torch.Tensor, row: int = 0) -> None:
        """Write tensor `name` (or its rows row..row+len(t)) at its planned place."""
        if name not in self.plan:
            raise KeyError(f"{self.path.name}: {name!r} is not in the plan")
        dt, shape = self.plan[name]
        if t.dtype != dt or tuple(t.shape[1:]) != shape[1:] or (row == 0 and t.dim() != len(shape)) or row + (t.shape[0] if t.dim() else 1) > (shape[0] if shape else 1):
            raise ValueError(f"{self.path.name}: {name!r} planned {dt} {list(shape)}, got {t.dtype} {list(t.shape)} at row {row}")
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        row_bytes = data.nbytes // max(t.shape[0], 1) if t.dim() else 0
        self.f.seek(self.data_start + self.offsets[name] + row * row_bytes)
        self.f.write(memoryview(data))
        self.written[name] += data.nbytes

    def close(self) -> Path:
        short = [k for k, n in self.written.items() if n != nbytes(*self.plan[k])]
        if short:
            self.abort()
            raise RuntimeError(f"{self.path.name}: tensors not (fully) written: {short[:3]}")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.chmod(self.tmp, 0o644)
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        if not self.f.closed:
            self.f.close()
        self.tmp.unlink(missing_ok=True)
