"""transformers as the baseline: its model for the compute floor, and its own continuous batching (its
paged-attention manager) on the same workload."""

import time

import torch


@torch.inference_mode()
def run_hf_continuous_batching(hf_model, requests: list[dict], block_size: int = 256) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=max(r["max_tokens"] for r in requests), eos_token_id=-1, pad_token_id=0
    )
    # transformers 5.17 names the page size block_size; later releases renamed it page_size.
    size_field = "page_size" if "page_size" in ContinuousBatchingConfig.__dataclass_fields__ else "block_size"
    cb_config = ContinuousBatchingConfig(**{size_field: block_size}, num_blocks=None, max_batch_tokens=None)
    manager = hf_model.init_continuous_batching(
        generation_config=generation_config, continuous_batching_config=cb_config
    )
    manager.start()
    start = time.perf_counter()
    try:
        for r in requests:
            # eos_token_id=-1 never matches: the same exact output lengths as ignore_eos.
            manager.add_request(
                r["prompt_token_ids"], request_id=r["id"], max_new_tokens=r["max_tokens"], eos_token_id=-1
            )
        num_out = {}
        while len(num_out) < len(requests):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("transformers' continuous batching stopped before finishing the workload")
            if result.is_finished():
                num_out[result.request_id] = len(result.generated_tokens)
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
    total = sum(num_out.values())
    return {"elapsed_s": round(elapsed, 2), "output_tokens": total, "output_tok_per_s": round(total / elapsed, 1)}


def load_hf_model_dir(model_dir, device: torch.device | None = None, dtype: torch.dtype | None = None):
    """On the device and in the dtype kvferry's settings resolve to by default (KVFERRY_DEVICE, KVFERRY_DTYPE):
    a stack started with the same environment runs there too."""
    from transformers import AutoModelForCausalLM

    from kvferry.common import settings
    from kvferry.common.engine_setup import resolve_device, resolve_dtype

    device = device or resolve_device(settings.from_env("device"))
    dtype = dtype or resolve_dtype(settings.from_env("dtype"), device)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def load_hf_model(engine):
    """transformers' model of the engine's own weights, on its device, in its dtype."""
    from kvferry.common.model_files import resolve_model

    return load_hf_model_dir(resolve_model(engine.config.model), engine.device, engine.dtype)
