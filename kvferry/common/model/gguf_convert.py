"""Converting a GGUF file once into a safetensors folder (fp32 weights, config, tokenizer), tensor by tensor.

transformers' GGUF loader de-quantizes every tensor into a whole float32 model before anything can be saved: a
4-bit file costs about eight times its size in memory. Here each tensor is de-quantized, named and written on its
own, straight into the output file, whose header is known beforehand (every tensor's shape and fp32 size): at most
one tensor is held at a time. The names and the rearrangement of Llama's q/k rows (llama.cpp permutes them for its
RoPE) are transformers' own, so the folder holds exactly what transformers' loader would have produced.
"""

import json
import os
import shutil
import sys
from pathlib import Path

ALIGNMENT = 8  # safetensors' data starts on an 8-byte boundary


def logical_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in numpy's order (GGUF lists the fastest dimension first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def plan(gguf_path: Path, config) -> tuple[list, dict]:
    """[(the GGUF tensor, its transformers name)] in file order, and the processor that rearranges them."""
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    reader = GGUFReader(str(gguf_path))
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)  # the config's fields, no weights
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed.get("config", {}))
    with torch.device("meta"):  # names only: no memory behind the parameters
        skeleton = AutoModelForCausalLM.from_config(config)
    names = get_gguf_hf_weights_map(skeleton, processor)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    planned = []
    for tensor in reader.tensors:
        name = names.get(tensor.name)
        if name is None or (tied and name == "lm_head.weight"):  # safetensors stores no aliases; the loader re-ties
            continue
        planned.append((tensor, name))
    return planned, processor


def _write_weights(planned: list, processor, path: Path) -> None:
    """One safetensors file of fp32 tensors, each de-quantized and written in turn."""
    import numpy as np
    from gguf import dequantize

    header, offset = {}, 0
    for tensor, name in planned:
        size = 4 * int(np.prod(logical_shape(tensor)))
        header[name] = {"dtype": "F32", "shape": list(logical_shape(tensor)), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % ALIGNMENT)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for tensor, name in planned:
            weights = dequantize(tensor.data, tensor.tensor_type)
            weights = processor.process(weights=weights, name=tensor.name).weights
            weights = np.ascontiguousarray(weights, dtype=np.float32)
            if weights.shape != tuple(header[name]["shape"]):
                raise ValueError(f"{tensor.name}: de-quantized to {weights.shape}, expected {header[name]['shape']}")
            f.write(weights.tobytes())
            del weights


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """De-quantize a GGUF file into an fp32 safetensors folder, whole or not at all (a temporary folder renamed)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    print(f"kvferry: converting {gguf_path.name} once into {out_dir}", file=sys.stderr, flush=True)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # The saved folder holds plain fp32 weights: it must not claim to be GGUF-quantized.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32  # what the weights are, as transformers' own save says
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    _write_weights(*plan(gguf_path, config), tmp / "model.safetensors")
    try:
        tmp.rename(out_dir)  # atomic: a half-written folder is never taken for a converted one
    except OSError:
        if not (out_dir / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same conversion first
