"""`kvferry bench random-model`: a model of a real model's shape with random weights, the default model's tokenizer
and chat template, saved as a Hugging Face folder. Memory and speed at real sizes can then be measured where no
weights can be downloaded: only the shape costs memory and time, and a random model's text does not matter.

The model is the default model's config (SmolLM2-135M-Instruct: Llama, a 49,152-token vocabulary, tied embeddings)
with the fields of SHAPES changed, made by transformers with its own initialisation and a fixed seed.
"""

import shutil
import sys
from pathlib import Path

# The fields that differ from the default model's config.json, from each model's published config.
SHAPES = {
    "smollm2-1.7b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=64,
    ),
    "smollm2-360m": dict(
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        head_dim=64,
    ),
    # The serving tests' model: a forward that costs nearly nothing (tests/tiny_models.save_tiny_chat_model).
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}
DTYPES = ("bfloat16", "float16", "float32")


def save_random_model(folder: Path, shape: str, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Build the model of this shape with seed `seed`, save it into folder (safetensors of dtype) with the default
    model's tokenizer, chat template and generation config; returns folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvferry.common.model_files import resolve_model

    default = resolve_model(None)
    config = AutoConfig.from_pretrained(default)
    for name, value in SHAPES[shape].items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    model.save_pretrained(folder)
    for path in default.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(path, folder)
    return Path(folder)


def add_parser(bench) -> None:
    p = bench.add_parser(
        "random-model",
        help="save a random-weight model of a real model's shape, with the default model's tokenizer",
        description="Save a model of a real model's shape with random weights (transformers' initialisation, a "
        "fixed seed) and the default model's tokenizer and chat template, as a Hugging Face folder that "
        "`kvferry serve --model` and llama.cpp's convert_hf_to_gguf.py take. For measuring memory and speed at "
        "real sizes; its text is noise.",
    )
    p.add_argument("--shape", required=True, choices=sorted(SHAPES), help="the model whose shape to take")
    p.add_argument("--out", required=True, type=Path, help="the folder to write: new, or empty")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="the saved weights' type (bfloat16)")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed (0)")
    p.set_defaults(func=cmd_bench_random_model)


def cmd_bench_random_model(args) -> int:
    out = args.out.expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"kvferry bench random-model: {out} exists and is not an empty folder; name a new one", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    save_random_model(out, args.shape, args.dtype, args.seed)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"{args.shape} ({args.dtype}, seed {args.seed}): {size / 2**30:.2f} GiB of weights in {out}")
    return 0
