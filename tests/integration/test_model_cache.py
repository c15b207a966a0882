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
