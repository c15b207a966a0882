"""One prepared copy of a model's weights per host: a quantized model, once made, is written into the cache as one
safetensors file, and every worker maps that file read-only instead of holding its own copy.

A prefill and a decode worker on one host then share the same pages (the kernel's page cache), and a restart
starts from the file: no checkpoint read, no float32 model, no calibration, no quantization. The file holds the
weights exactly as the CPU kernels read them (int8 weights in the layout small_matmul.c streams, its outlier
rows tiled), so its name carries everything they depend on: the checkpoint's files, the settings, the code that
made them, and the CPU (prepared_path). A file that is truncated, not this format, or not for this key is made
again; one that someone else could have written is refused (cache_trust), as the compiled kernels are.
"""

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from kvferry.common import model_files
from kvferry.common.model import gguf_int4, int4_linear, int8_linear, llama, quant_calibration
from kvferry.common.model import quantize as quantize_module
from kvferry.common.model.cpu_memory import returning_freed_memory
from kvferry.common.model.int4_linear import Int4Linear
from kvferry.common.model.int8_linear import Int8Linear
from kvferry.common.model.loader import safetensors_header, weight_files
from kvferry.kernels.cpu import build, int4_matmul, small_matmul

log = logging.getLogger("kvferry.engine")

FORMAT = "kvferry-prepared-2"
# What a tensor's storage is: the model's own code rebuilds these (RoPE's tables), the file need not hold them
_REBUILT = ("rope_cos", "rope_sin")
_QUANTIZED = {"int8": Int8Linear, "int4": Int4Linear}  # the metadata lists each kind's layers by name
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8, "U8": torch.uint8,
           "I32": torch.int32, "I64": torch.int64}  # fmt: skip


def _layout() -> str:
    """Whether int8 weights are kept interleaved here (the C kernels loaded and taking every row count), which the
    file's layout follows: a file of the other layout would cost each worker a private copy."""
    from kvferry.common.model.runner import enable_cpu_kernels
    from kvferry.kernels.cpu import layer_ops

    enable_cpu_kernels()
    return "interleaved" if small_matmul.takes_every_row_count() and layer_ops.handles() else "plain"


def prepared_path(model_dir: Path, dtype: torch.dtype, quantization: str) -> Path:
    """The file for this model, dtype and quantization on this CPU with this code, in the cache's `prepared`
    folder (this user's alone, or a ConfigError). Its name starts with what tells a model's files apart for the
    same setup (pruned by save), then the key of everything else."""
    identity = [FORMAT, str(dtype), quantization, build.cpu_features(), str(torch.__version__), _layout()]
    for path in [*weight_files(model_dir), model_dir / "config.json"]:
        status = path.stat()
        identity += [path.name, str(status.st_size), str(status.st_mtime_ns)]
    made_by = (
        gguf_int4,
        int4_linear,
        int4_matmul,
        int8_linear,
        llama,
        quant_calibration,
        quantize_module,
        small_matmul,
    )
    for module in made_by:  # how the weights are made and laid out
        identity.append(Path(module.__file__).read_text())
    key = hashlib.sha256("\0".join(identity).encode()).hexdigest()[:20]
    setup = f"{model_dir.name}-{quantization}-{str(dtype).removeprefix('torch.')}"
    return model_files.cache_folder("prepared") / f"{setup}-{key}.safetensors"


@contextlib.contextmanager
def preparing(path: Path):
    """Held while this process makes path: a worker starting beside it waits, then maps the file it wrote."""
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _weights(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(each distinct weight tensor by its first name, each other name of it -> that name)."""
    tensors, aliases, seen = {}, {}, {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if tensor is None or name.rsplit(".", 1)[-1] in _REBUILT:
            continue
        identity = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if identity in seen:
            aliases[name] = seen[identity]
        else:
            seen[identity] = name
            tensors[name] = tensor.detach().contiguous()
    return tensors, aliases


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict) -> None:
    """tensors in safetensors' format, each one's bytes written straight from its memory (safetensors' save_file
    copies every tensor to bytes first: a second copy of the model at preparing's peak, docs/benchmarks.md). The
    widest types first, so that every tensor starts at a multiple of its item size."""
    names = {dtype: name for name, dtype in _DTYPES.items()}
    ordered = sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0]))
    header, offset = {"__metadata__": metadata}, 0
    for name, tensor in ordered:
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": names[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts on an 8-byte boundary
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for _, tensor in ordered:
            if tensor.numel():
                f.write(tensor.reshape(-1).view(torch.uint8).numpy())


def save(model: nn.Module, path: Path) -> None:
    """Write the model's weights to path, whole or not at all (a temporary file renamed into place)."""
    tensors, aliases = _weights(model)
    metadata = {"format": FORMAT, "name": path.name, "aliases": json.dumps(aliases)}
    for kind, cls in _QUANTIZED.items():
        metadata[kind] = json.dumps([name for name, module in model.named_modules() if isinstance(module, cls)])
    partial = path.with_suffix(".partial")  # one name, under the lock: a killed attempt's leftover is overwritten
    try:
        _write_safetensors(tensors, partial, metadata)
        os.chmod(partial, 0o644)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    _prune(path)


def _prune(path: Path) -> None:
    """One copy per host: delete this setup's files of older keys (an older checkpoint or kvferry), each only while
    holding its lock, so never one a worker is preparing; a worker still mapping one keeps its pages until it
    ends. Lock files stay: deleting one that is held would let a second preparer in."""
    setup = path.name.rsplit("-", 1)[0] + "-"
    for old in path.parent.glob(f"{setup}*.safetensors"):
        if old == path or len(old.name) != len(path.name):
            continue
        with open(old.with_suffix(".lock"), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # being prepared now
            old.unlink(missing_ok=True)


def _entries(header: dict, data_bytes: int) -> dict[str, tuple[torch.dtype, list[int], int]] | None:
    """Each tensor's (dtype, shape, offset in the data) where every entry is well formed, one after the other and
    exactly covering data_bytes; else None."""
    entries, spans = {}, []
    for name, entry in header.items():
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
            return None
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            return None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return None
        dtype, (lo, hi) = _DTYPES[entry["dtype"]], offsets
        if not 0 <= lo <= hi or hi - lo != math.prod(shape) * dtype.itemsize or lo % dtype.itemsize:
            return None
        entries[name] = (dtype, shape, lo)
        spans.append((lo, hi))
    spans.sort()
    if [lo for lo, _ in spans] != [0] + [hi for _, hi in spans[:-1]] or (spans[-1][1] if spans else 0) != data_bytes:
        return None
    return entries


def _read(path: Path) -> tuple[dict, dict, int] | None:
    """(each tensor's dtype, shape and offset; the metadata; where the data starts), or None (the reason logged)
    where path is not a whole prepared file of this format and name: truncated, of another version, or not
    safetensors at all."""
    try:
        header, start = safetensors_header(path)
        size = path.stat().st_size
    except FileNotFoundError:
        return None  # pruned in the meantime (another setup's newer file)
    except ValueError as exc:
        log.warning("prepared weights: %s; making them again", exc)
        return None
    metadata = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT or metadata.get("name") != path.name:
        found = metadata.get("format") if isinstance(metadata, dict) else None
        log.warning("prepared weights %s: of another version (%s); making them again", path, found)
        return None
    try:
        for key in ("aliases", *_QUANTIZED):
            metadata[key] = json.loads(metadata[key])
    except (KeyError, TypeError, ValueError):
        log.warning("prepared weights %s: its metadata is not whole; making them again", path)
        return None
    entries = _entries(header, size - start)
    if entries is None:
        log.warning("prepared weights %s: %d bytes that its header does not describe; making them again", path, size)
        return None
    return entries, metadata, start


def load(model: nn.Module, path: Path) -> bool:
    """Put path's weights into model (built without its weights: skip_weight_init) as read-only views of the file
    mapped into memory, every Int8Linear or Int4Linear the file names in place of its nn.Linear. False where the
    file is missing or not whole (the caller makes it again; the model may then be half changed: build another)."""
    if not path.exists():
        return False
    with model_files.trusted_cache():  # someone else's file would be run as this user's weights
        from kvferry import cache_trust

        try:
            cache_trust.check(path, model_files.cache_root())
        except FileNotFoundError:
            return False
    found = _read(path)
    if found is None:
        return False
    entries, metadata, start = found
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays mapped while a tensor views it
    except FileNotFoundError:
        return False
    tensors = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")  # read-only, as meant
        for name, (dtype, shape, lo) in entries.items():
            flat = torch.frombuffer(mapped, dtype=dtype, count=math.prod(shape), offset=start + lo)
            tensors[name] = flat.view(shape)
    kinds = {name: cls for kind, cls in _QUANTIZED.items() for name in metadata[kind]}
    int8_linear.swap_linears(model, lambda name, linear: kinds[name].shell(linear) if name in kinds else linear)
    try:
        for alias, name in metadata["aliases"].items():
            tensors[alias] = tensors[name]
        for name, tensor in tensors.items():
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            if attr in owner._parameters:
                owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
            elif attr in owner._buffers:
                owner._buffers[attr] = tensor
            else:
                raise AttributeError(f"{name} is no weight of this model")
    except (AttributeError, KeyError, TypeError) as exc:
        log.warning("prepared weights %s: %s; making them again", path, exc)
        return False
    return True


def load_or_prepare(model_dir: Path, path: Path, dtype: torch.dtype, max_model_len: int | None, quantize) -> tuple:
    """load_model's result for a quantized model on the CPU, its weights mapped from path (prepared_path's): made
    first where there is none (quantize(model) loads and quantizes a model built without its weights, in place),
    one process at a time."""
    from kvferry.common.model.loader import load_model
    from kvferry.common.model.runner import enable_cpu_kernels

    cpu = torch.device("cpu")
    with preparing(path):
        model, config, max_model_len = load_model(model_dir, dtype, cpu, max_model_len, read_weights=False)
        if load(model, path):
            log.info("weights mapped from %s (%.2f GiB, shared with every worker on this host)", path,
                     path.stat().st_size / 2**30)  # fmt: skip
            return model, config, max_model_len
        with returning_freed_memory():  # each float layer's memory back to the system once quantized
            made, _, _ = load_model(model_dir, dtype, cpu, max_model_len, read_weights=False)
            quantize(made)
            enable_cpu_kernels()
            int8_linear.interleave_linears(made)  # the layout the kernels read, kept in the file
            save(made, path)
            del made  # this process's own copy: the file's pages replace it
        log.info("weights prepared once into %s (%.2f GiB)", path, path.stat().st_size / 2**30)
        model, config, max_model_len = load_model(model_dir, dtype, cpu, max_model_len, read_weights=False)
        if not load(model, path):
            raise OSError(f"the prepared weights just written to {path} do not read back")
    return model, config, max_model_len
