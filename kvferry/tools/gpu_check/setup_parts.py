"""The first two parts: what the machine is, and the model every later part runs."""

import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import time

from kvferry.tools.gpu_check.part import Context, PartFailed

# What scripts/gpu_check_prepare.sh carries as wheels; the GPU machine's Python has the rest.
CARRIED = {"pyzmq": "zmq", "starlette": "starlette", "uvicorn": "uvicorn", "jsonschema": "jsonschema"}
CARRIED_DEPENDENCIES = ("jsonschema-specifications", "referencing", "rpds-py")
# Modules the later parts import: a missing package shows here, in seconds, rather than in each part.
KVFERRY_MODULES = (
    "kvferry.common.engine",
    "kvferry.kernels.triton.decode_attention",
    "kvferry.kernels.triton.prefill_attention",
    "kvferry.kernels.triton.store_kv",
    "kvferry.kernels.triton.int8_matmul",
    "kvferry.services.gateway.main",
    "kvferry.services.prefill.worker",
    "kvferry.services.decode.worker",
    "kvferry.tools.bench.cli",
    "kvferry.tools.bench.hf_baseline",
)


def environment(ctx: Context) -> None:
    # Each finding recorded as soon as it is known: a part killed at its timeout still says how far it got, and
    # the driver takes the GPU for missing only where torch said so (cuda_available False).
    import torch

    cuda = torch.cuda.is_available()
    versions = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
    }
    ctx.record("versions", versions)
    import transformers
    import triton

    versions.update(triton=triton.__version__, transformers=transformers.__version__)
    ctx.record("versions", versions)
    if cuda:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        versions.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            memory_gib=round(total / 2**30, 1),
            free_gib=round(free / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
        )
        ctx.record("versions", versions)
    ctx.record("carried_packages", _carried())
    broken = {}
    for name in KVFERRY_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # every import error is a finding
            broken[name] = f"{type(exc).__name__}: {exc}"
    ctx.record("kvferry_imports", broken or "all import")
    if cuda:
        versions["driver"] = _nvidia_smi("driver_version")  # last: a slow nvidia-smi must not hide the rest
        ctx.record("versions", versions)
    ctx.summary = (
        f"{versions.get('gpu', 'no GPU')}, {versions.get('memory_gib', '-')} GiB, driver {versions.get('driver', '-')}; "
        f"python {versions['python']}, torch {versions['torch']}, triton {versions['triton']}, "
        f"transformers {versions['transformers']}"
    )
    if not cuda and not ctx.dry_run:
        raise PartFailed("no CUDA GPU: torch.cuda.is_available() is False. The GPU check needs an NVIDIA GPU.")
    if cuda and os.environ.get("TRITON_INTERPRET"):
        raise PartFailed("TRITON_INTERPRET is set: the kernels would run interpreted, and graph capture fails")
    problems = [f"{n}: {v}" for n, v in ctx.findings["carried_packages"].items() if not v.startswith("ok")]
    if broken or problems:
        raise PartFailed("; ".join([*problems, *(f"import {n}: {e}" for n, e in broken.items())]))


def _nvidia_smi(field: str) -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def _carried() -> dict:
    """Each carried package: its version and where it loads from, and whether what it requires is installed."""
    from packaging.requirements import Requirement

    found = {}
    for dist_name in (*CARRIED, *CARRIED_DEPENDENCIES):
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            found[dist_name] = "MISSING"
            continue
        unmet = []
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                unmet.append(f"{req} (missing)")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{req} (have {have})")
        where = ""
        if dist_name in CARRIED:
            try:
                where = f" from {os.path.dirname(importlib.import_module(CARRIED[dist_name]).__file__)}"
            except Exception as exc:  # a wheel for another Python or platform: say so, and go on
                unmet.append(f"import {CARRIED[dist_name]}: {type(exc).__name__}: {exc}")
        found[dist_name] = f"ok {dist.version}{where}" if not unmet else f"{dist.version}: unmet {', '.join(unmet)}"
    return found


def model(ctx: Context) -> None:
    """SmolLM2's own config and tokenizer with random weights: the real model's shapes and vocabulary, so that
    the kernels, the graphs and the stack see what they will serve (its weights do not fit what travels)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.monotonic()
    source = ctx.prepared / "model"
    if not (source / "config.json").is_file():
        raise PartFailed(f"{source}/config.json is missing: run `make gpu-check-prepare` and carry .gpu-check/")
    shutil.rmtree(ctx.model_dir, ignore_errors=True)
    shutil.copytree(source, ctx.model_dir)
    config = AutoConfig.from_pretrained(ctx.model_dir)
    ctx.record("tokenizer", _tokenizer(ctx, config))
    if ctx.dry_run:  # SmolLM2's tokenizer and vocabulary, two small layers
        from kvferry.tools.bench.random_model import SHAPES

        for key, value in SHAPES["tiny"].items():
            setattr(config, key, value)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    # bf16 values kept in fp32: the fp32 and the bf16 runs then start from the same weights, and differ only in
    # their arithmetic.
    hf_model = hf_model.to(device=device, dtype=torch.float32)
    hf_model.save_pretrained(ctx.model_dir)
    from kvferry.common.model_files import resolve_model

    resolve_model(ctx.model_dir)  # kvferry takes the folder
    weights = sum(f.stat().st_size for f in ctx.model_dir.glob("*.safetensors"))
    params = sum(p.numel() for p in hf_model.parameters())
    ctx.record(
        "model",
        {
            "folder": str(ctx.model_dir),
            "files": sorted(f.name for f in ctx.model_dir.iterdir()),
            "parameters": params,
            "weights_mib": round(weights / 2**20, 1),
            "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "built_on": device,
            "seconds": round(time.monotonic() - started, 1),
        },
    )
    ctx.summary = (
        f"{ctx.findings['tokenizer']['class']} loads; "
        f"{params / 1e6:.1f}M parameters, {config.num_hidden_layers} layers, random weights "
        f"(bf16 values in fp32), built on {device} in {time.monotonic() - started:.1f} s"
    )


def _tokenizer(ctx: Context, config) -> dict:
    """The prepared tokenizer, loaded as the engine loads it (AutoTokenizer): files written by a later
    transformers than this machine's must fail here, once, saying so, rather than in every part after it."""
    import transformers

    from kvferry.common.engine_setup import load_tokenizer

    written_by = getattr(config, "transformers_version", None)
    try:
        tokenizer = load_tokenizer(str(ctx.model_dir))
        if tokenizer is None:
            raise ValueError("the prepared folder has no tokenizer.json")
        ids = tokenizer.encode("The GPU check")
        chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    except Exception as exc:
        raise PartFailed(
            f"transformers {transformers.__version__} cannot load the prepared tokenizer (its files were written by "
            f"transformers {written_by}; the engine loads it the same way, so every later part would fail): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return {
        "class": type(tokenizer).__name__,
        "files_written_by_transformers": written_by,
        "vocabulary": len(tokenizer),
        "encodes": ids,
        "chat_template": bool(chat),
    }
