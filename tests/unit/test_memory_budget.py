"""A worker's memory budget before its model loads (common/memory_budget.py): the weights counted from the
safetensors headers, the check's message, the machine's available memory, and a KV cache sized from it, for one
worker or serve's workers together."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from kvferry.common.config import EngineConfig
from kvferry.common.errors import ConfigError
from kvferry.common.memory_budget import (
    PREFILL_KV_SHARE,
    Budget,
    available_memory,
    kv_bytes_per_token,
    most_kv_cache,
    parameter_count,
    plan_serve,
    sized_kv_cache,
)


def test_the_weights_are_counted_from_the_headers_of_the_files_the_loader_reads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    one, two = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({"a": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16)}, tmp_path / one)
    save_file({"c": torch.zeros(2, 2, 2, dtype=torch.int8), "lm_head.weight": torch.zeros(4)}, tmp_path / two)
    index = {"weight_map": {"a": one, "b": one, "c": two, "lm_head.weight": two}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"all": torch.zeros(1000)}, tmp_path / "consolidated.safetensors")  # Mistral's own copy: not loaded
    (tmp_path / "notes.txt").write_text("not weights")
    assert parameter_count(tmp_path) == 15 + 7 + 8 + 4
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "tie_word_embeddings": True}))
    assert parameter_count(tmp_path) == 15 + 7 + 8  # a tied model keeps one copy of a stored lm_head


def test_a_file_whose_header_is_not_one_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(ConfigError, match="not a safetensors file"):
        parameter_count(tmp_path)


def test_a_budget_that_fits_passes_and_one_that_does_not_names_the_numbers_and_the_setting():
    gib = 2**30
    Budget(weights=2 * gib, kv_cache=1 * gib, available=3 * gib).check()
    Budget(weights=2 * gib, kv_cache=10**15, available=None).check()  # unknown: no refusal on a guess
    with pytest.raises(ConfigError) as refused:
        Budget(weights=6 * gib, kv_cache=17 * gib, available=22 * gib).check()
    text = str(refused.value)
    assert "6.00 GiB" in text and "17.00 GiB" in text and "23.00 GiB" in text and "22.00 GiB" in text
    assert "--kv-cache-memory" in text and "KVFERRY_KV_CACHE_MEMORY" in text
    assert Budget(2 * gib, gib, None).describe().endswith("available unknown")


def test_this_machine_reports_its_available_memory():
    assert 0 < available_memory() < 2**50


def test_a_kv_cache_sized_from_memory_takes_the_utilizations_share_less_every_workers_weights():
    gib = 2**30
    assert sized_kv_cache(2 * gib, 20 * gib, 0.9) == 16 * gib  # 18 of 20, less 2 of weights
    assert sized_kv_cache(4 * gib, 20 * gib, 0.9, workers=2) == 7 * gib  # (18 - 2 x 2) / 2 each
    assert sized_kv_cache(4 * gib, 20 * gib, 0.9, workers=2, most=3 * gib) == 3 * gib  # no more than it can fill
    assert sized_kv_cache(2 * gib, None, 0.9, most=5 * 2**20) == 5 * 2**20  # no /proc/meminfo: 1 GiB, or less
    with pytest.raises(ConfigError) as refused:
        sized_kv_cache(12 * gib, 20 * gib, 0.5, workers=2)  # 10 of 20, all of it the weights' 12
    text = str(refused.value)
    assert "the weights (2 workers') take 12.00 GiB" in text and "--memory-utilization" in text and "0.5" in text
    assert "--kv-cache-memory" in text


def test_the_most_a_worker_could_fill_bounds_its_cache(tmp_path):
    layers, kv_heads, head_dim = 4, 2, 16
    config = {"num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
              "hidden_size": 64, "head_dim": head_dim, "max_position_embeddings": 1000}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, float16
    assert kv_bytes_per_token(config, 2) == per_token
    engine = EngineConfig(model=str(tmp_path), max_num_seqs=3, block_size=16)
    assert most_kv_cache(tmp_path, engine, 2) == 3 * (1000 + 16) * per_token
    engine = EngineConfig(model=str(tmp_path), max_num_seqs=3, block_size=16, max_model_len=100)
    assert most_kv_cache(tmp_path, engine, 4) == 3 * (100 + 16) * per_token * 2


def test_serves_workers_are_planned_together(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.zeros(2**20)}, tmp_path / "model.safetensors")  # 4 MiB in float32
    available = available_memory()
    prefill, decode = plan_serve(tmp_path, 4, None, 0.5, most=0)
    total = available // 2 - 2 * 4 * 2**20  # half of what is available, less both workers' weights
    assert abs(prefill + decode - total) < 2**26  # MemAvailable moves a little between reads
    assert prefill == int((prefill + decode) * PREFILL_KV_SHARE)  # a quarter: prompts only until shipped
    assert plan_serve(tmp_path, 4, None, 0.5, most=2**20) == (2**20, 2**20)  # no more than either could fill
    prefill_shared, decode_shared = plan_serve(tmp_path, 4, None, 0.5, shared_weights=True)  # int8: mapped once
    assert abs(prefill_shared + decode_shared - (total + 4 * 2**20)) < 2**26
    assert plan_serve(tmp_path, 4, 2**20, 0.5) == (2**20, 2**20)  # given: the same for both, where they fit
    with pytest.raises(ConfigError) as refused:
        plan_serve(tmp_path, 4, available, 0.5)  # two of all there is
    assert "not enough memory for serve's 2 workers" in str(refused.value) and "--kv-cache-memory" in str(refused.value)
