"""The roofline's arithmetic on a tiny model worked out by hand, and measurements that cannot run here."""

import pytest
import torch

from kvferry.tools.bench import roofline, roofline_measure, workload

TINY = roofline.ModelShape.from_config(
    {
        "hidden_size": 4,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 2,
        "vocab_size": 10,
    },
    bytes_per_param=4,
)
# Prompt of 3 with 3 outputs, prompt of 2 with 1 output, prefilled in chunks of 4.
REQUESTS = [{"prompt_token_ids": [5] * 3, "max_tokens": 3}, {"prompt_token_ids": [5] * 2, "max_tokens": 1}]


def test_model_shape_counts_by_hand():
    # q 2x2=4 wide, k and v 1x2=2 wide each.
    assert TINY.family_params() == {"qkv": 4 * 8, "o": 4 * 4, "gate_up": 2 * 4 * 8, "down": 8 * 4, "lm_head": 40}
    assert TINY.layer_flops_per_token() == 2 * (32 + 16 + 64 + 32)
    assert TINY.lm_head_flops_per_token() == 80
    assert TINY.weight_bytes() == (144 + 40) * 4
    assert TINY.attention_flops_per_pair() == 4 * 2 * 2
    assert TINY.kv_bytes_per_token() == 2 * 2 * 4


def test_int8_weights_are_a_byte_each_plus_what_each_output_channel_reads():
    config = {"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}
    config |= {"num_key_value_heads": 1, "head_dim": 2, "vocab_size": 10}
    cpu = roofline_measure.model_shape(config, torch.float32, "int8", torch.device("cpu"))
    # Output channels: qkv 4 + 2 + 2, o 4, gate/up 16, down 4, lm_head 10 = 42; each reads a 4-byte scale and,
    # on the CPU, 32 outlier columns in half precision.
    assert cpu.output_channels() == 42
    assert cpu.weight_bytes() == 184 * 1 + 42 * (4 + 2 * 32)
    assert cpu.kv_bytes_per_token() == TINY.kv_bytes_per_token()  # the KV cache stays in fp32
    assert roofline_measure.model_shape(config, torch.float32, None, torch.device("cpu")) == TINY


def test_the_int8_gemm_rate_is_measured_through_the_int8_path():
    gemm = roofline_measure.measure_gemm(torch.device("cpu"), torch.float32, 64, 32, trials=1, quantization="int8")
    assert "int8 weights" in gemm["shape"] and gemm["peak_flop_per_s"] > 0
    assert set(gemm["decode_flop_per_s"]) == set(roofline_measure.DECODE_SIZES)


def test_schedule_chunks_prefill_and_decodes_every_unfinished_request():
    S = roofline.Step
    assert roofline.schedule(REQUESTS, chunk=4) == [
        S(True, rows=4, lm_head_rows=1, attention_pairs=1 + 2 + 3 + 1, kv_tokens_read=3 + 1),  # all of A, B's first
        S(True, rows=1, lm_head_rows=1, attention_pairs=2, kv_tokens_read=2),  # B's second token, after its first
        S(False, rows=1, lm_head_rows=1, attention_pairs=4, kv_tokens_read=4),  # A alone, at context 3 + 1
        S(False, rows=1, lm_head_rows=1, attention_pairs=5, kv_tokens_read=5),
    ]


def test_roofline_takes_the_larger_of_compute_and_memory_per_step():
    steps = roofline.schedule(REQUESTS, chunk=4)
    r = roofline.roofline(TINY, steps, decode_rates={1: 1000.0}, peak_rate=2000.0, bandwidth=2000.0)
    # FLOPs: prefill 1232 + 112 and 368 + 32 at the peak; decode 368 + 64 and 368 + 80 at 1000 FLOP/s.
    # Bytes: 736 of weights plus 16 per KV token read (4, 2, 4, 5 tokens), at 2000 B/s.
    assert r["prefill_s"] == pytest.approx(1344 / 2000 + 768 / 2000)  # the second chunk is memory-bound
    assert r["decode_s"] == pytest.approx(432 / 1000 + 448 / 1000)
    assert r["memory_bound_steps"] == 1
    assert r["output_tokens"] == 4
    assert r["output_tok_per_s"] == pytest.approx(4 / r["total_s"])
    assert r["gemm_flops"] == 1232 + 368 + 368 + 368 and r["attention_flops"] == 16 * (7 + 2 + 4 + 5)


def test_roofline_uses_what_was_measured_and_says_so():
    steps = roofline.schedule(REQUESTS, chunk=4)
    memory_only = roofline.roofline(TINY, steps, None, None, bandwidth=2000.0)
    assert memory_only["total_s"] == pytest.approx((800 + 768 + 800 + 816) / 2000)
    assert "bandwidth only" in memory_only["limits_used"]
    assert "GEMM rate only" in roofline.roofline(TINY, steps, {1: 1000.0}, 2000.0, None)["limits_used"]
    assert "cannot_compute" in roofline.roofline(TINY, steps, None, None, None)


def test_gemm_rate_interpolates_and_holds_flat_beyond():
    assert roofline.gemm_rate({1: 10.0, 3: 30.0}, 2) == 20.0
    assert roofline.gemm_rate({1: 10.0, 3: 30.0}, 5) == 30.0


def test_std32_schedule_covers_every_prompt_and_output_token():
    requests = workload.generate("std-32")
    steps = roofline.schedule(requests)
    assert sum(s.rows for s in steps if s.prefill) == sum(len(r["prompt_token_ids"]) for r in requests)
    assert sum(s.lm_head_rows for s in steps) == sum(r["max_tokens"] for r in requests)


def test_no_packed_path_is_reported_not_measured():
    # The model's CPU GEMMs go through packed oneDNN weights only in fp32: bf16 has no such path to measure.
    gemm = roofline_measure.measure_gemm(torch.device("cpu"), torch.bfloat16, 4, 8, trials=1)
    assert "no packed oneDNN path" in gemm["not_measured"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA measures it")
def test_missing_cuda_is_reported_and_nothing_is_computed():
    limits = roofline_measure.measure(torch.device("cuda"), torch.bfloat16, TINY, trials=1)
    assert all("CUDA is not available" in limits[name]["not_measured"] for name in ("gemm", "bandwidth"))
    assert "cannot_compute" in roofline_measure.workload_roofline(TINY, limits, REQUESTS)
