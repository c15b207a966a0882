"""A worker's memory budget before its model loads (common/memory_budget.py): the weights counted from the
safetensors headers, the check's message, and the machine's available memory."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from kvferry.common.errors import ConfigError
from kvferry.common.memory_budget import Budget, available_memory, parameter_count


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
