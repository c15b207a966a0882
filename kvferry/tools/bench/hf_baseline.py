"""transformers as the baseline: its model for the compute floor, and its own continuous batching (its
paged-attention manager) on the same workload."""

import dataclasses
import inspect
import time

import torch

POLL_S = 1.0  # how long each wait for a result lasts before the manager's thread is checked


# no_grad, as transformers' own generate_batch: not inference_mode, whose tensors (the paged cache a warmup here
# makes) the manager's generation thread, outside inference mode, may not update in place.
@torch.no_grad()
def run_hf_continuous_batching(
    hf_model,
    requests: list[dict],
    block_size: int = 256,
    max_batch_tokens: int = 2048,
    timeout_s: float = 600.0,
    stage=lambda name: None,
) -> dict:
    """transformers' continuous batching on the requests, each to its exact max_tokens, at most max_batch_tokens a
    step (kvferry's default). Its paged cache is sized to the requests, not to the device: its warmup would run
    attention over the whole device's worth. Arguments go by the names this transformers takes (its API moves
    between releases). A dead generation thread raises its own exception; past timeout_s, TimeoutError. Its CUDA
    graphs are captured outside the timing, as kvferry's engine does before it serves. stage(name): called as each
    step begins, for a caller that must say where a run was cut off."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=max(r["max_tokens"] for r in requests), eos_token_id=-1, pad_token_id=0
    )
    # transformers 5.17 names the page size block_size; later releases renamed it page_size.
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    size_field = "page_size" if "page_size" in fields else "block_size"
    blocks = sum(-(-(len(r["prompt_token_ids"]) + r["max_tokens"]) // block_size) for r in requests)
    wanted = {
        size_field: block_size,
        "num_blocks": blocks + len(requests),  # one spare each: a last token that opens a block
        "max_batch_tokens": max_batch_tokens,
        "max_requests_per_batch": len(requests),
    }
    cb_config = ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})
    manager = hf_model.init_continuous_batching(
        **_accepted(
            hf_model.init_continuous_batching,
            generation_config=generation_config,
            continuous_batching_config=cb_config,
            workload_hints=_workload_hints(requests),
        )
    )
    deadline = time.monotonic() + timeout_s
    warmup_s, finished = None, False
    try:
        if hasattr(manager, "warmup"):
            stage("warmup (its CUDA graphs)")
            started = time.perf_counter()
            manager.warmup()
            warmup_s = round(time.perf_counter() - started, 2)
        stage("generation")
        manager.start()
        start = time.perf_counter()
        for r in requests:
            # eos_token_id=-1 never matches: the same exact output lengths as ignore_eos.
            manager.add_request(
                r["prompt_token_ids"],
                **_accepted(manager.add_request, request_id=r["id"], max_new_tokens=r["max_tokens"], eos_token_id=-1),
            )
        num_out = {}
        while len(num_out) < len(requests):
            result = manager.get_result(timeout=POLL_S)
            if result is None:
                _check_alive(manager, len(num_out), len(requests))
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"transformers' continuous batching finished {len(num_out)} of {len(requests)} requests "
                        f"in {timeout_s:.0f} s"
                    )
                continue
            if result.is_finished():
                if getattr(result, "error", None):
                    raise RuntimeError(
                        f"transformers' continuous batching failed request {result.request_id}: {result.error}"
                    )
                num_out[result.request_id] = len(result.generated_tokens)
        elapsed = time.perf_counter() - start
        finished = True
    finally:
        if finished:  # else the stage that failed stays the last one named
            stage("stop")
        _stop(manager, quietly=not finished)
    total = sum(num_out.values())
    return {
        "elapsed_s": round(elapsed, 2),
        "output_tokens": total,
        "output_tok_per_s": round(total / elapsed, 1),
        "warmup_s": warmup_s,
        "device": str(hf_model.device),
        "dtype": str(hf_model.dtype).removeprefix("torch."),
    }


def _workload_hints(requests: list[dict]):
    """transformers' WorkloadHints for these requests (it sizes the decode path's block tables by them), or None
    where this transformers has none."""
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    hints = dict(
        max_prompt_length=max(len(r["prompt_token_ids"]) for r in requests),
        max_generated_length=max(r["max_tokens"] for r in requests),
        num_requests=len(requests),
    )
    fields = {f.name for f in dataclasses.fields(WorkloadHints)}
    return WorkloadHints(**{k: v for k, v in hints.items() if k in fields})


def _accepted(function, **kwargs) -> dict:
    """kwargs less the names function does not declare (add_request passes names it does not know on to the
    logits processors, so a **kwargs does not count)."""
    parameters = inspect.signature(function).parameters
    return {k: v for k, v in kwargs.items() if k in parameters}


def _check_alive(manager, finished: int, total: int) -> None:
    """Raise what stopped the manager's generation thread, if it stopped."""
    is_running = getattr(manager, "is_running", None)
    if is_running is None or is_running():
        return
    status = getattr(manager, "background_thread_status", None)
    error = getattr(status, "fatal_error", None)
    message = f"transformers' generation thread stopped after {finished} of {total} requests"
    if error is not None:
        raise RuntimeError(f"{message}: {type(error).__name__}: {error}") from error
    raise RuntimeError(message)


def _stop(manager, quietly: bool) -> None:
    """Stop the manager's thread (at most 10 s) and let go of what it holds; quietly: an error that is already
    on its way out must not be replaced by one of these."""
    try:
        manager.stop(**_accepted(manager.stop, block=True, timeout=10))
        is_running = getattr(manager, "is_running", lambda: False)
        destroy = getattr(manager, "destroy", None)
        if destroy is not None and not is_running():  # destroy would wait, unbounded, for a thread still running
            destroy()
    except Exception:
        if not quietly:
            raise


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


def refuse_sampled(args) -> None:
    """transformers' run here decodes greedily: against a sampled workload it would measure different work."""
    from kvferry.common.errors import ConfigError
    from kvferry.tools.bench import workload

    if args.baseline == "hf" and args.workload in workload.SAMPLED:
        raise ConfigError(f"--baseline hf decodes greedily; {args.workload} samples: run it without --baseline hf")


def add_hf_baseline(args, hf_model, requests: list[dict], report: dict) -> None:
    """`--baseline hf`: transformers' continuous batching on the workload, against kvferry's best run."""
    from kvferry.tools.bench.report import say

    hf = report["hf"] = run_hf_continuous_batching(hf_model, requests)
    hf["kvferry_speedup"] = round(report["kvferry"]["output_tok_per_s"] / hf["output_tok_per_s"], 2)
    if "floor" in report:
        hf["fraction_of_floor"] = round(report["floor"]["floor_s"] / hf["elapsed_s"], 3)
    say(args, "transformers continuous batching", hf)
