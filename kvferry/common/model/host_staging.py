"""A step's small host arrays (token ids, positions, slots, block tables, sampling parameters) sent to the device
as one copy: each pageable copy of a list would make the host wait. On CUDA they are packed into one pinned buffer,
sent without blocking, each array a view of the device buffer; the pinned allocator keeps a buffer from reuse until
its copy has run. On the CPU each array is simply its own tensor.
"""

import array

import torch

ALIGN = 8  # bytes: every part starts where its widest element type (int64, fp32) may start


# A list of Python numbers goes into a tensor through an array of these C types, several times faster than
# torch.tensor(list) (which converts element by element).
_TYPECODES = {torch.long: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}


def host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """values as a 1-D CPU tensor of dtype, each converted as torch.tensor converts it."""
    code = _TYPECODES.get(dtype)
    if code is None or not values:
        return torch.tensor(values, dtype=dtype)
    return torch.frombuffer(array.array(code, values), dtype=dtype)


class Staged:
    """One array's place in a HostStaging; `tensor` is set by the upload."""

    def __init__(self, values: list, dtype: torch.dtype, shape: tuple[int, ...]):
        self.values, self.dtype, self.shape = values, dtype, shape
        self.tensor: torch.Tensor | None = None


class HostStaging:
    def __init__(self, device: torch.device, packed: bool | None = None):
        """packed: one buffer (default on CUDA only; a test packs on the CPU to check the layout)."""
        self.device = device
        self.packed = device.type == "cuda" if packed is None else packed
        self.parts: list[Staged] = []

    def add(self, values: list, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> Staged:
        """values: flat; shape: the tensor's shape (default: 1-D)."""
        part = Staged(values, dtype, shape if shape is not None else (len(values),))
        self.parts.append(part)
        return part

    def upload(self) -> None:
        if not self.packed:
            for part in self.parts:
                part.tensor = host_tensor(part.values, part.dtype).view(part.shape)
            return
        spans, total = [], 0
        for part in self.parts:
            size = len(part.values) * part.dtype.itemsize
            spans.append(slice(total, total + size))
            total += -(-size // ALIGN) * ALIGN
        host = torch.empty(max(total, ALIGN), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        for part, span in zip(self.parts, spans):
            host[span].view(part.dtype).copy_(host_tensor(part.values, part.dtype))
        device_buffer = host.to(self.device, non_blocking=True)
        for part, span in zip(self.parts, spans):
            part.tensor = device_buffer[span].view(part.dtype).view(part.shape)
