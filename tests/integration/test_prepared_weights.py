"""int8 (and int4) weights prepared once per host (common/model/prepared_weights.py): the first engine writes the file, the
next maps it read-only and serves the same tokens; a file that is truncated or of another version is made again,
one that someone else could have written is refused."""

import logging
import os

import pytest
import torch

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.errors import ConfigError
from kvferry.common.model.prepared_weights import prepared_path
from kvferry.common.sampling import SamplingParams
from tests.tiny_models import save_tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 3, 99, 12]]


@pytest.fixture
def model(tmp_path):
    save_tiny_model("llama", tmp_path)
    engine = LLMEngine(_config(tmp_path))
    path = prepared_path(tmp_path, engine.dtype, "int8")
    yield tmp_path, path, _greedy(engine)
    for leftover in (path, path.with_suffix(".lock")):  # the cache is the user's: leave nothing of a test's in it
        leftover.unlink(missing_ok=True)


def _config(folder) -> EngineConfig:
    return EngineConfig(model=str(folder), quantization="int8", kv_cache_memory=2**22, block_size=8, num_threads=1)


def _greedy(engine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


def _mapped_from(engine, path) -> bool:
    """Whether a weight of the engine lies in a mapping of path (read off /proc/self/maps)."""
    address = engine.model.layers[0].mlp.down_proj.qweight.data_ptr()
    for line in open("/proc/self/maps"):
        span, *_, name = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in span.split("-"))
        if name.strip() == str(path) and lo <= address < hi:
            return True
    return False


def test_the_first_engine_prepares_the_file_and_the_next_maps_it(model, caplog):
    folder, path, cold = model
    assert path.is_file() and path.stat().st_mode & 0o777 == 0o644
    with caplog.at_level(logging.INFO, logger="kvferry.engine"):
        warm = LLMEngine(_config(folder))
    assert "weights mapped from" in caplog.text and "prepared once" not in caplog.text
    assert _mapped_from(warm, path)
    assert not warm.model.layers[0].mlp.down_proj.qweight.untyped_storage().resizable()
    assert _greedy(warm) == cold


@pytest.mark.parametrize("damage", ["truncated", "another version", "a bad entry"])
def test_a_damaged_file_is_made_again(model, caplog, damage):
    folder, path, cold = model
    if damage == "truncated":
        os.truncate(path, path.stat().st_size - 100)
    elif damage == "another version":
        raw = bytearray(path.read_bytes())
        at = raw.index(b"kvferry-prepared-")
        raw[at : at + 17] = b"kvferry-prepared-".upper()  # the same length: only the format differs
        path.write_bytes(bytes(raw))
    else:
        raw = bytearray(path.read_bytes())
        at = raw.index(b'"dtype":"I8"')
        raw[at : at + 12] = b'"dtype":"Q4"'  # a type no prepared file holds, in a header otherwise whole
        path.write_bytes(bytes(raw))
    with caplog.at_level(logging.INFO, logger="kvferry.engine"):
        again = LLMEngine(_config(folder))
    expected = {"truncated": "that its header does not describe", "another version": "of another version",
                "a bad entry": "that its header does not describe"}[damage]  # fmt: skip
    assert expected in caplog.text and "making them again" in caplog.text and "prepared once" in caplog.text
    assert _mapped_from(again, path) and _greedy(again) == cold


def test_a_file_others_may_write_is_refused(model):
    folder, path, _ = model
    path.chmod(0o664)
    with pytest.raises(ConfigError) as refused:
        LLMEngine(_config(folder))
    assert str(path) in str(refused.value) and "chmod go-w" in str(refused.value)


def test_a_changed_checkpoint_gets_a_file_of_its_own(model):
    folder, path, _ = model
    (folder / "config.json").write_text((folder / "config.json").read_text() + "\n")
    assert prepared_path(folder, torch.float32, "int8") != path


def test_int4_weights_are_prepared_once_and_mapped_with_the_same_tokens(tmp_path, caplog):
    save_tiny_model("llama", tmp_path)
    config = EngineConfig(model=str(tmp_path), quantization="int4", kv_cache_memory=2**22, block_size=8, num_threads=1)
    cold = LLMEngine(config)
    path = prepared_path(tmp_path, cold.dtype, "int4")
    try:
        assert path.is_file() and path != prepared_path(tmp_path, cold.dtype, "int8")
        caplog.clear()  # the cold engine's lines
        with caplog.at_level(logging.INFO, logger="kvferry.engine"):
            warm = LLMEngine(config)
        assert "weights mapped from" in caplog.text and "prepared once" not in caplog.text
        gate_up = warm.model.layers[0].mlp.gate_up_proj
        assert type(gate_up).__name__ == "Int4Linear" and not gate_up.qweight.untyped_storage().resizable()
        assert type(warm.model.layers[0].mlp.down_proj).__name__ == "Int8Linear"  # 96 wide: not whole 64s
        assert _greedy(warm) == _greedy(cold)
    finally:
        for leftover in (path, path.with_suffix(".lock")):
            leftover.unlink(missing_ok=True)
