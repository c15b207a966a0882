"""Loading a model: its safetensors into kvferry's own Llama-family module, and converting a GGUF file once.
Finding the folder is kvferry.common.model_files, which imports no torch.
"""

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

from kvferry.common.errors import ModelLoadError
from kvferry.common.model_config import ModelConfig
from kvferry.common.model_files import resolve_model

# resolve_model is re-exported: the engine finds the model through here.
__all__ = ["convert_gguf", "load_model", "resolve_model", "skip_weight_init", "weight_files"]


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """De-quantize a GGUF file into an fp32 safetensors folder. transformers shows the progress bar."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"kvferry: converting {gguf_path.name} once into {out_dir}", file=sys.stderr, flush=True)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    from safetensors.torch import save_file

    tmp.mkdir(parents=True)
    config = model.config
    # The saved folder holds plain fp32 weights: it must not claim to be GGUF-quantized.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # safetensors stores no aliases; the loader re-ties
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    try:
        tmp.rename(out_dir)  # atomic: a half-written folder is never taken for a converted one
    except OSError:
        if not (out_dir / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same conversion first


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


def load_model(model_dir: Path, dtype, device, max_model_len: int | None = None):
    """Build the model from a resolved folder and load its safetensors. Returns (model, ModelConfig, max_model_len)."""
    import torch
    from safetensors.torch import load_file

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
    # Built in its dtype on its device, and the checkpoint read on the host, each weight cast as it is copied in: the
    # device never holds a float32 copy of the model beside the model (the peak of building in fp32, then casting).
    with skip_weight_init(), torch.device(device), default_dtype(dtype):
        model = LlamaModel(config, max_model_len)
    weights = {}
    for f in files:
        weights.update(load_file(f))
    model.load_hf_state_dict(weights)
    return model.eval().requires_grad_(False), config, max_model_len
