"""A model's architecture from its config.json, read without transformers (whose import and config object were most
of a worker's start, docs/benchmarks.md).

ModelConfig reads the numbers from the file with the defaults transformers' config class of each architecture fills
in where the file is silent (model_files' CONFIG_DEFAULTS), so the model is built as transformers would configure it;
a unit test holds every field to AutoConfig's. A null where transformers wants a value is refused, as there. Only a
RoPE scaling other than the default needs transformers: llama.rope_cos_sin loads AutoConfig then, from `path`.
"""

from dataclasses import dataclass
from pathlib import Path

from kvferry.common.errors import ModelLoadError
from kvferry.common.model_files import check_architecture, max_model_len_of, read_config

DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    rope_parameters: dict
    max_position_embeddings: int
    max_model_len: int  # the positions served: the context, or the sliding window where one is used
    eos_token_id: int | list[int] | None

    @classmethod
    def load(cls, model_dir: Path) -> "ModelConfig":
        where = str(Path(model_dir) / "config.json")
        config = read_config(model_dir)
        check_architecture(config.get("model_type"), where)

        def get(name):  # a null where transformers wants a value: it refuses such a file too
            value = config.get(name)
            if value is None:
                raise ModelLoadError(f"{name} is null in {where}")
            return value

        def derived(name, default):  # a field transformers derives when it is missing or null
            value = config.get(name)
            return default if value is None else value

        heads = get("num_attention_heads")
        return cls(
            path=Path(model_dir),
            model_type=config["model_type"],
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_hidden_layers=get("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=derived("num_key_value_heads", heads),
            head_dim=derived("head_dim", get("hidden_size") // heads),
            rms_norm_eps=get("rms_norm_eps"),
            tie_word_embeddings=get("tie_word_embeddings"),
            attention_bias=get("attention_bias"),
            mlp_bias=get("mlp_bias"),
            hidden_act=get("hidden_act"),
            rope_parameters=rope_parameters(config, where),
            max_position_embeddings=get("max_position_embeddings"),
            max_model_len=max_model_len_of(config),
            eos_token_id=config.get("eos_token_id"),
        )


def rope_parameters(config: dict, where: str) -> dict:
    """RoPE's type and parameters as transformers 5 gathers them: the older rope_scaling first (whose type may be
    called "type"), else rope_parameters, with rope_theta beside them."""
    given = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if any(isinstance(value, dict) for value in given.values()):
        raise ModelLoadError(f"RoPE parameters per layer type ({', '.join(given)}) in {where} are not supported")
    rope = dict(given)
    rope["rope_type"] = given.get("rope_type") or given.get("type") or "default"
    rope.setdefault("rope_theta", config.get("rope_theta") or DEFAULT_ROPE_THETA)
    return rope
