"""The default model: converted once into the cache, then loaded from it without converting again."""

import pytest

from kvferry.common import model_files

pytestmark = pytest.mark.slow


def test_default_model_is_converted_once_and_reused(monkeypatch):
    first = model_files.resolve_model(None)  # `make test` has already converted it (make model)
    assert (first / "config.json").is_file() and (first / "model.safetensors").is_file()
    assert (first / "tokenizer.json").is_file()

    def no_second_conversion(*_):
        raise AssertionError("converted again")

    monkeypatch.setattr(model_files, "convert_gguf_in_child", no_second_conversion)
    assert model_files.resolve_model(None) == first
    assert model_files.resolve_model(str(model_files.default_gguf_path())) == first
    assert first.is_relative_to(model_files.cache_root())


def test_a_folders_name_keeps_its_dots_and_a_files_name_loses_its_suffix(tmp_path):
    folder = tmp_path / "Qwen3-0.6B"
    folder.mkdir()
    (tmp_path / "model.Q4.gguf").write_bytes(b"")
    assert model_files.served_model_name(folder) == "Qwen3-0.6B"
    assert model_files.served_model_name(tmp_path / "model.Q4.gguf") == "model.Q4"
    assert model_files.served_model_name(None) == model_files.DEFAULT_MODEL_NAME


def test_a_gguf_converted_tensor_by_tensor_holds_what_transformers_loader_makes_of_it(tmp_path):
    # transformers de-quantizes the whole file into a float32 model; the conversion writes one tensor at a time.
    # Every weight must come out the same, names, shapes and values, q/k rows rearranged as transformers does.
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from kvferry.common.model.gguf_convert import convert_gguf

    gguf = model_files.default_gguf_path()
    convert_gguf(gguf, tmp_path / "converted")
    converted = load_file(tmp_path / "converted" / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    expected = reference.state_dict()
    expected.pop("lm_head.weight")  # tied: the loader ties it again
    assert set(converted) == set(expected)
    for name, tensor in expected.items():
        assert converted[name].dtype == torch.float32 and torch.equal(converted[name], tensor), name
    assert (tmp_path / "converted" / "tokenizer.json").is_file()
