"""ModelConfig reads config.json without transformers: every field the model is built from must be what
transformers' AutoConfig makes of the same file, whatever the file leaves out or sets; what transformers refuses
is refused."""

import json

import pytest
from transformers import AutoConfig

from kvferry.common.errors import ModelLoadError
from kvferry.common.model_config import ModelConfig
from kvferry.common.model_files import max_model_len_of
from tests.tiny_models import tiny_config

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
OPTIONAL = (
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "rope_parameters",
    "max_position_embeddings",
    "sliding_window",
    "use_sliding_window",
    "eos_token_id",
    "vocab_size",
    "intermediate_size",
)
VARIANTS = (
    [("as saved", {}, ())]
    + [(f"without {name}", {}, (name,)) for name in OPTIONAL]
    + [
        ("null head_dim", {"head_dim": None}, ()),
        ("old rope_theta, no rope_parameters", {"rope_theta": 5e5}, ("rope_parameters",)),
        ("old rope_scaling with 'type'", {"rope_scaling": {"type": "linear", "factor": 2.0}}, ("rope_parameters",)),
        ("rope_scaling beside rope_parameters", {"rope_scaling": {"type": "linear", "factor": 2.0}}, ()),
        ("attention and mlp biases", {"attention_bias": True, "mlp_bias": True}, ()),
        ("tied, eos list", {"tie_word_embeddings": True, "eos_token_id": [1, 3]}, ()),
        ("sliding window used", {"sliding_window": 100, "use_sliding_window": True}, ()),
    ]
)


def hf_head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# Every architecture with every variant, but a null head_dim for qwen3, which transformers refuses to load.
CASES = [(arch, v) for arch in ARCHS for v in VARIANTS if not (arch == "qwen3" and v[0] == "null head_dim")]


@pytest.mark.parametrize(("arch", "variant"), CASES, ids=[f"{arch}-{v[0]}" for arch, v in CASES])
def test_every_field_is_what_autoconfig_makes_of_the_file(tmp_path, arch, variant):
    _, setting, dropping = variant
    tiny_config(arch).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    for name in dropping:
        raw.pop(name, None)
    raw.update(setting)
    path.write_text(json.dumps(raw))

    ours, theirs = ModelConfig.load(tmp_path), AutoConfig.from_pretrained(tmp_path)
    for name in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "tie_word_embeddings",
        "hidden_act",
        "max_position_embeddings",
        "eos_token_id",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.head_dim == hf_head_dim(theirs)
    assert ours.attention_bias == getattr(theirs, "attention_bias", False)
    assert ours.mlp_bias == getattr(theirs, "mlp_bias", False)
    assert ours.rope_parameters == dict(theirs.rope_parameters)
    assert ours.max_model_len == max_model_len_of(theirs)


def test_an_unknown_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        ModelConfig.load(tmp_path)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"rms_norm_eps": None}, "rms_norm_eps is null"),
        ({"tie_word_embeddings": None}, "tie_word_embeddings is null"),
        ({"max_position_embeddings": None}, "max_position_embeddings is null"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "per layer type"),
    ],
)
def test_a_config_transformers_refuses_or_kvferry_cannot_build_is_a_clear_error(tmp_path, setting, message):
    tiny_config("qwen2").save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **setting}))
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.load(tmp_path)
