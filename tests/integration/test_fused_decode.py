"""Decode on the CPU, int8, int4 or fp32, runs every layer in one C call (common/model/fused_decode.py): the same logits,
bit for bit, as the layers one call at a time, at each row count it takes (one to four, or any batch where every
layer is int8 and the int8 product takes every row count); more rows and other models go layer by layer."""

import random

import pytest
import torch

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.model import fused_decode
from kvferry.common.model.cpu_linear import PackedLinear
from kvferry.common.model.fused_decode import FusedDecode
from kvferry.common.model.int4_linear import Int4Linear
from kvferry.common.model.int8_linear import Int8Linear
from kvferry.common.sampling import SamplingParams
from kvferry.kernels.cpu import decode_layers, panel_matmul, small_matmul
from tests.tiny_models import VOCAB, save_tiny_model


def engine_for(folder, arch: str, quantization: str | None = "int8") -> LLMEngine:
    save_tiny_model(arch, folder)
    config = EngineConfig(
        model=str(folder), kv_cache_memory=8 * 2**20, block_size=8, num_threads=1, quantization=quantization
    )
    return LLMEngine(config)


def _panels_everywhere(model) -> bool:
    """Whether oneDNN packed every fp32 decoder-layer weight in panels the loop takes, on this machine."""
    packed = [m for m in model.layers.modules() if isinstance(m, PackedLinear)]
    return bool(packed) and all(fused_decode.fits(m) for m in packed)


def decode_logits(engine, prompts, fused: bool, monkeypatch) -> tuple[list, list[torch.Tensor], int]:
    """Greedy outputs, each decode step's logits, and how many steps ran in the one-call loop."""
    model = engine.runner.model
    loop = model.fused_decode
    model.fused_decode = loop if fused else None
    steps, calls = [], []
    original_run = FusedDecode.run

    def counted_run(self, *args):
        calls.append(1)
        return original_run(self, *args)

    monkeypatch.setattr(FusedDecode, "run", counted_run)
    original_execute = engine.runner.execute

    def recording_execute(plan, *args, **kwargs):
        result = original_execute(plan, *args, **kwargs)
        if not plan.is_prefill:
            steps.append(engine.runner.last_logits.clone())
        return result

    monkeypatch.setattr(engine.runner, "execute", recording_execute)
    try:
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        outputs = [o.output_token_ids for o in engine.generate(prompts, params)]
    finally:
        model.fused_decode = loop
        monkeypatch.undo()
    return outputs, steps, len(calls)


@pytest.mark.parametrize("quantization", ["int8", "int4", None])
@pytest.mark.parametrize("arch", ["llama", "mistral"])  # biases everywhere, GQA, an untied head; MQA, no biases
def test_the_one_call_loop_gives_the_layers_logits_bit_for_bit(tmp_path, arch, quantization, monkeypatch):
    engine = engine_for(tmp_path, arch, quantization)
    if quantization is None and not _panels_everywhere(engine.runner.model):
        pytest.skip("oneDNN packs these fp32 weights in a layout other than the panels the C product reads")
    assert engine.runner.model.fused_decode is not None
    if quantization == "int4":
        assert isinstance(engine.runner.model.layers[0].mlp.gate_up_proj, Int4Linear)
    if quantization is not None:  # the runner's layout: interleaved where the C product takes every row count
        linears = [m for m in engine.runner.model.layers.modules() if isinstance(m, Int8Linear)]
        assert {m.qweight.dim() for m in linears} == {4 if small_matmul._any_rows else 2}
    # Past four rows as many as the layers' own C products take (AVX2): every row count for int8 without VNNI, the
    # panel product's max_rows for fp32; elsewhere the layer path uses other products there (torch._int_mm, oneDNN)
    if quantization is not None:  # int4: the down projection (96 wide, not in whole 64s) is int8
        most = decode_layers.ANY_ROWS if small_matmul.takes_every_row_count() else 4
    else:
        most = panel_matmul.max_rows()
    assert engine.runner.model.fused_decode.loop.max_rows == most
    row_counts = [rows for rows in (1, 2, 3, 4, 7, 33) if rows <= most]  # its scratch grows twice, from four rows
    rng = random.Random(2)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 40))] for _ in range(max(row_counts))]
    prompts[1] = prompts[1][:1] * 30  # a loud row beside quiet ones
    for rows in row_counts:
        fused, fused_steps, calls = decode_logits(engine, prompts[:rows], True, monkeypatch)
        layered, layered_steps, no_calls = decode_logits(engine, prompts[:rows], False, monkeypatch)
        assert calls == len(fused_steps) > 0 and no_calls == 0
        assert fused == layered
        assert len(fused_steps) == len(layered_steps)
        for got, expected in zip(fused_steps, layered_steps):
            assert torch.equal(got, expected), (rows, (got - expected).abs().max())


def test_more_rows_than_it_takes_go_layer_by_layer_with_the_same_tokens(tmp_path, monkeypatch):
    engine = engine_for(tmp_path, "llama")
    engine.runner.model.fused_decode.loop.max_rows = 4  # as where torch._int_mm takes more rows: this engine's alone
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 40))] for _ in range(6)]
    together, _, calls = decode_logits(engine, prompts, True, monkeypatch)
    # All six decode to the end together (max_tokens, no EOS): every step has six rows, and none takes the loop.
    assert calls == 0
    alone = [decode_logits(engine, [p], True, monkeypatch)[0][0] for p in prompts[:2]]
    assert alone == together[:2]


def test_models_it_does_not_take_run_layer_by_layer(tmp_path):
    qwen3 = engine_for(tmp_path / "qwen3", "qwen3")  # per-head q/k norms
    assert qwen3.runner.model.fused_decode is None
    fp32 = engine_for(tmp_path / "fp32", "llama", quantization=None)  # taken only where every weight is in panels
    assert (fp32.runner.model.fused_decode is not None) == _panels_everywhere(fp32.runner.model)


def test_a_batch_without_the_paged_cache_goes_layer_by_layer(tmp_path):
    # `bench engine`'s paging comparison and int8 calibration attend through batches of their own
    from kvferry.common.model.quant_calibration import DenseCausalBatch

    engine = engine_for(tmp_path, "llama")
    loop = engine.runner.model.fused_decode
    assert loop is not None and not loop.takes(torch.zeros(1, 64), DenseCausalBatch())
