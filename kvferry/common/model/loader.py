"""Loading a model: its safetensors into kvferry's own Llama-family module (a GGUF file is converted once before,
gguf_convert.py). Finding the folder is kvferry.common.model_files, which imports no torch.
"""

import contextlib
import json
from pathlib import Path

from kvferry.common.errors import ModelLoadError
from kvferry.common.model_config import ModelConfig
from kvferry.common.model_files import resolve_model

# resolve_model is re-exported: the engine finds the model through here.
__all__ = ["load_model", "resolve_model", "safetensors_header", "skip_weight_init", "weight_files"]


SAFETENSORS_HEADER_LIMIT = 100 * 2**20  # a safetensors header longer than this is not one


def safetensors_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (its JSON, __metadata__ included) and where its data starts, read without the
    data. ValueError where the file is not one: shorter than a header, a header longer than the limit or than the
    file, or not JSON."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < length <= min(SAFETENSORS_HEADER_LIMIT, size - 8):
            raise ValueError(f"{path} is not a safetensors file (a header of {length} bytes in {size})")
        return json.loads(f.read(length)), 8 + length


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors: those its index names, else model*.safetensors. Other files beside them
    (Mistral's consolidated.safetensors, in its own naming) are not part of the transformers checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({model_dir / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise ModelLoadError(f"no model*.safetensors weights in {model_dir}")
    return files


@contextlib.contextmanager
def skip_weight_init():
    """Build layers without random initialisation: the checkpoint overwrites every weight. (Not the meta device: it
    pulls in torch's compiler stack, which slows every start.)"""
    from torch import nn

    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method


def _tensors(files: list[Path], select=None):
    """(name, tensor) of every weight in the files (or those whose name select(name) takes), read one at a time: the
    checkpoint is never all in memory beside the model (the file's pages are the kernel's page cache, which it can
    drop)."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if select is None or select(name):
                    yield name, f.get_tensor(name)


def layer_of(name: str) -> int | None:
    """The decoder layer a transformers weight name belongs to (model.layers.N....), or None for the others."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def load_in_parts(model_dir: Path, model) -> tuple:
    """For a model built without its weights (load_model's read_weights False): (load the weights outside the
    decoder layers, load decoder layer i, check that every weight came), each part read from the checkpoint when
    called, so that only the layers loaded so far are in memory (prepared_weights.py quantizes each as it goes)."""
    files = weight_files(model_dir)
    expected, loaded = set(model.state_dict()), set()

    def outer() -> None:
        loaded.update(model.load_hf_state_dict(_tensors(files, lambda n: layer_of(n) is None), complete=False))

    def layer(i: int) -> None:
        loaded.update(model.load_hf_state_dict(_tensors(files, lambda n: layer_of(n) == i), complete=False))

    def check() -> None:
        absent = expected - loaded
        if absent:
            raise ModelLoadError(f"weights missing from the checkpoint: {', '.join(sorted(absent)[:5])}")

    return outer, layer, check


def load_model(model_dir: Path, dtype, device, max_model_len: int | None = None, read_weights: bool = True):
    """Build the model from a resolved folder and load its safetensors. Returns (model, ModelConfig, max_model_len).
    read_weights False: its weights left unset and untouched (no memory behind them yet), for
    prepared_weights.load to map."""
    import torch

    from kvferry.common.model.llama import LlamaModel, default_dtype

    config = ModelConfig.load(model_dir)
    limit = config.max_model_len
    if max_model_len is not None and max_model_len < 2:
        raise ModelLoadError(
            f"max_model_len must be at least 2 (a prompt token and a generated one), got {max_model_len}"
        )
    if max_model_len is not None and max_model_len > limit:
        raise ModelLoadError(f"max_model_len {max_model_len} exceeds the model's limit {limit}")
    max_model_len = limit if max_model_len is None else max_model_len
    files = weight_files(model_dir)
    if not read_weights:
        with skip_weight_init(), torch.device(device), default_dtype(dtype):
            return LlamaModel(config, max_model_len).eval().requires_grad_(False), config, max_model_len
    # Built in its dtype on its device, and the checkpoint read on the host, each weight cast as it is copied in: the
    # device never holds a float32 copy of the model beside the model (the peak of building in fp32, then casting).
    with skip_weight_init(), torch.device(device), default_dtype(dtype):
        model = LlamaModel(config, max_model_len)
    model.load_hf_state_dict(_tensors(files))
    return model.eval().requires_grad_(False), config, max_model_len
