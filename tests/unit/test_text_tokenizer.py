"""The gateway's torch-free tokenizer and model files give what transformers gives, and the gateway never loads torch."""

import json
import shutil
import subprocess
import sys

import pytest

from kvferry.common.model_files import max_model_len_of, read_config, resolve_model
from kvferry.common.text_tokenizer import TextTokenizer
from tests.tiny_models import tiny_config

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "héllo wörld, ñandú, 日本語のテキスト, 中文, Ελληνικά, русский",
    "emoji 🙂👍🏽 🇫🇷 👨‍👩‍👧 and a lone 🦀",
    "tabs\t\tand\n\n\nnewlines    and     runs of      spaces\r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>kvferry<file_sep>x = 1",
    "text with <|im_end|> in the middle and <not_a_special> one",
    "don't , . ? ! 're 've 'm",
    "",
    " ",
    "a" * 300,
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in ünïcode 🙂?"},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaces\n\nand lines  "}],
]

slow = pytest.mark.slow  # these need the default model (make model)


@pytest.fixture(scope="module")
def default_dir():
    return resolve_model(None)


def assert_same(folder) -> None:
    from transformers import AutoTokenizer

    hf, ours = AutoTokenizer.from_pretrained(folder), TextTokenizer(folder)
    assert len(ours) == len(hf)
    assert ours.special_tokens_map == hf.special_tokens_map
    assert (ours.tokenizer_class, ours.add_bos_token) == (type(hf).__name__, hf.add_bos_token)
    assert ours.chat_template == hf.chat_template
    for text in TEXTS:
        for add_special_tokens in (True, False):
            ids = hf.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens=add_special_tokens) == ids, text
        for skip_special_tokens in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == hf.decode(
                ids, skip_special_tokens=skip_special_tokens
            ), text
    every_id = list(range(len(hf)))
    assert [ours.decode([i]) for i in every_id] == [hf.decode([i]) for i in every_id]
    if hf.chat_template is None:
        return
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            ids = hf.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
            )
            assert (
                ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False) == text
            )
            assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == ids


@slow
def test_the_default_model_tokenizes_as_transformers_does(default_dir):
    assert_same(default_dir)


TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] | upper }}: {{ m['content'] | tojson }}"
    "{% if 'tool_calls' in m %}{{ m['tool_calls'] | tojson }}{% endif %}"
    "{% if loop.last and m['role'] == 'system' %}{% break %}{% endif %}\n{% endfor %}"
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}[{{ ns.n }}]"
    "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
    "{% if add_generation_prompt %}{% generation %}ASSISTANT:{% endgeneration %}{% endif %}"
)


@slow
@pytest.mark.parametrize(
    "config, extra_files",
    [
        ({"add_bos_token": True, "add_eos_token": True}, {}),  # dropped by transformers: tokenizer.json decides
        ({"bos_token": {"__type": "AddedToken", "content": "<s>", "normalized": False}, "eos_token": "</s>"}, {}),
        ({"additional_special_tokens": ["<tool>", "<|im_start|>"], "image_token": "<img>", "pad_token": "<pad>"}, {}),
        ({"added_tokens_decoder": {"3": {"content": "<repo_name>", "normalized": False, "special": False}}}, {}),
        ({"chat_template": [{"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": "T"}]}, {}),
        ({"clean_up_tokenization_spaces": True, "split_special_tokens": True}, {}),
        ({"tokenizer_class": "PreTrainedTokenizerFast"}, {"chat_template.jinja": TEMPLATE}),
        ({"bos_token": None}, {"special_tokens_map.json": json.dumps({"bos_token": {"content": "<s>"}})}),
    ],
)
def test_tokenizer_configs_are_read_as_transformers_reads_them(default_dir, tmp_path, config, extra_files):
    """The default tokenizer.json under other tokenizer_config.json settings: special tokens as strings or
    AddedToken dicts, tokens tokenizer.json lacks, model-specific tokens, several chat templates, the clean-up."""
    shutil.copy(default_dir / "tokenizer.json", tmp_path)
    base = json.loads((default_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    for name, text in extra_files.items():
        (tmp_path / name).write_text(text)
    assert_same(tmp_path)


@slow
def test_the_chat_template_takes_tools_and_renders_as_transformers_does(default_dir, tmp_path):
    from transformers import AutoTokenizer

    shutil.copy(default_dir / "tokenizer.json", tmp_path)
    shutil.copy(default_dir / "tokenizer_config.json", tmp_path)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    hf, ours = AutoTokenizer.from_pretrained(tmp_path), TextTokenizer(tmp_path)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"city": {"type": "string"}}}}]
    messages = [
        {"role": "user", "content": 'say "<b>" & ü'},
        {"role": "assistant", "content": "ok", "tool_calls": None},
    ]
    for kwargs in ({}, {"tools": tools}, {"tools": tools, "add_generation_prompt": True}):
        assert ours.apply_chat_template(messages, tokenize=False, **kwargs) == hf.apply_chat_template(
            messages, tokenize=False, **kwargs
        )
    with pytest.raises(Exception, match="[Ee]mpty"):
        ours.apply_chat_template([])


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", {}),
        ("llama", {"max_position_embeddings": None}),  # the class default, as transformers fills it in
        ("mistral", {"sliding_window": 128}),
        ("mistral", {"sliding_window": "absent"}),  # transformers' default window, 4096
        ("qwen2", {"use_sliding_window": True, "sliding_window": 100}),
        ("qwen2", {"sliding_window": 100}),  # a window that is not used
        ("qwen3", {}),
    ],
)
def test_the_length_limit_without_transformers_is_the_workers_limit(tmp_path, arch, overrides):
    from transformers import AutoConfig

    tiny_config(arch).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for name, value in overrides.items():
        if value in (None, "absent"):
            config.pop(name, None)
        else:
            config[name] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert max_model_len_of(read_config(tmp_path)) == max_model_len_of(AutoConfig.from_pretrained(tmp_path))


GATEWAY_START = """
import sys
import kvferry.services.gateway.api, kvferry.services.gateway.main, kvferry.services.gateway.server
from kvferry.services.gateway.main import load_text_side
from kvferry.tools.cli import build_parser

build_parser().parse_args(["gateway"])  # `kvferry gateway` builds the whole CLI, every bench command's flags too

tokenizer, max_model_len = load_text_side(None)
ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
assert tokenizer.decode(ids, skip_special_tokens=True) and tokenizer.encode("Hi") and max_model_len > 0
print(sorted(m for m in ("torch", "transformers", "triton") if m in sys.modules))
"""


@slow
def test_the_gateway_starts_its_tokenizer_without_torch():
    """In a fresh interpreter: other tests' imports would hide an import of torch in this one's sys.modules."""
    done = subprocess.run([sys.executable, "-c", GATEWAY_START], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
