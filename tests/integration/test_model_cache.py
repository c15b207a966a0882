"""The default model: converted once into the cache, then loaded from it without converting again."""

import pytest

from kvferry.common.model import loader

pytestmark = pytest.mark.slow


def test_default_model_is_converted_once_and_reused(monkeypatch):
    first = loader.resolve_model(None)  # `make test` has already converted it (make model)
    assert (first / "config.json").is_file() and (first / "model.safetensors").is_file()
    assert (first / "tokenizer.json").is_file()

    def no_second_conversion(*_):
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "convert_gguf", no_second_conversion)
    assert loader.resolve_model(None) == first
    assert loader.resolve_model(str(loader.default_gguf_path())) == first
    assert first.is_relative_to(loader.cache_root())
