"""A model folder's tokenizer and chat template without transformers, and so without torch (the gateway's).

It sets up tokenizer.json (through `tokenizers`) and the chat template (through jinja2) step for step as transformers
5 sets up its generic TokenizersBackend (tokenizer_class "TokenizersBackend" or "PreTrainedTokenizerFast", the default
model's): the same tokens added in the same order, tokenizer.json's own post-processor (transformers drops
tokenizer_config.json's add_bos_token and add_eos_token beside a tokenizer.json), no truncation or padding, and the
template in the same sandbox with the same globals and filters. A test holds the two to identical ids and strings.
Model-specific classes (LlamaTokenizer, ...) rebuild their pipeline in transformers instead; for those the gateway
warns that the two may differ.
"""

import functools
import json
import os
from datetime import datetime
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, processors

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast", "PreTrainedTokenizer")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases for a message's reasoning


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _added_token(value, special: bool | None = None) -> AddedToken | str:
    """A token as tokenizer_config.json writes it: a string, or an AddedToken's fields."""
    if not isinstance(value, dict):
        return value
    fields = {k: v for k, v in value.items() if k in ("content", "single_word", "lstrip", "rstrip", "normalized")}
    return AddedToken(**fields, special=value.get("special", False) if special is None else special)


def _with_special(token: AddedToken) -> AddedToken:
    return AddedToken(
        token.content,
        single_word=token.single_word,
        lstrip=token.lstrip,
        rstrip=token.rstrip,
        normalized=token.normalized,
        special=True,
    )


def _load_config(folder: Path) -> tuple[dict, list[AddedToken]]:
    """tokenizer_config.json (with the legacy special_tokens_map.json and added_tokens.json where transformers
    still reads them), and the added tokens transformers hands its tokenizer at construction."""
    config = _read_json(folder / "tokenizer_config.json")
    if "added_tokens_decoder" in config:
        decoder = {int(i): _added_token(t) for i, t in config["added_tokens_decoder"].items()}
    else:
        for key, value in _read_json(folder / "special_tokens_map.json").items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                config[key] = _added_token(value, special=True)
            elif key == "extra_special_tokens" and isinstance(value, list):
                merged = list(config.get("extra_special_tokens") or [])
                for token in value:
                    token = _added_token(token, special=True)
                    if token not in merged:
                        merged.append(token)
                config[key] = merged
            else:
                config[key] = value
        decoder = {}
        named = {str(_added_token(config[k])) for k in NAMED_SPECIAL_TOKENS if config.get(k)}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        named.update(str(_added_token(t)) for t in extra if not isinstance(extra, dict))
        for content, index in _read_json(folder / "added_tokens.json").items():
            is_special = content in named
            decoder[index] = AddedToken(content, normalized=not is_special, special=is_special)
        for token in _read_json(folder / "tokenizer.json").get("added_tokens", []):
            decoder[token["id"]] = _added_token(token)
    return config, [decoder[i] for i in sorted(decoder)]


def _special_tokens(config: dict, added_tokens: list[AddedToken]) -> tuple[dict, list]:
    """The named special tokens ({bos_token: ...}) and the extra ones, as transformers collects them. The named
    come first, then any other *_token (a model's own, e.g. image_token): the order decides the ids of tokens
    that tokenizer.json lacks."""
    is_token = lambda k, v: (
        k.endswith("_token") and (isinstance(v, str | AddedToken) or (isinstance(v, dict) and "content" in v))
    )
    keys = [k for k in NAMED_SPECIAL_TOKENS if is_token(k, config.get(k))]
    keys += [k for k, v in config.items() if k not in NAMED_SPECIAL_TOKENS and is_token(k, v)]
    named = {k: _added_token(config[k]) for k in keys}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra, dict):  # named model-specific tokens
        named.update({k: _added_token(v) for k, v in extra.items()})
        extra = []
    by_content = {str(t): t for t in added_tokens}
    for key in NAMED_SPECIAL_TOKENS:  # a named token takes the added token of the same text, fields and all
        if key in named:
            named[key] = by_content.get(str(named[key]), named[key])
    return named, [_added_token(t) for t in extra]


def _add_tokens(backend: Tokenizer, added_tokens: list[AddedToken], named: dict, extra: list) -> None:
    """The calls transformers makes on the backend, in its order: adding a token that is there already with other
    fields changes it, and a token tokenizer.json lacks gets the next id."""
    # TokenizersBackend.__init__: the added tokens again (all of them), then the special tokens still missing ...
    to_add = list(added_tokens)
    known = [t.content for t in backend.get_added_tokens_decoder().values()] + [str(t) for t in to_add]
    for token in [*named.values(), *extra]:
        if str(token) not in known:
            to_add.append(token)
            known.append(str(token))
    named_contents = {str(t) for t in named.values()}
    if to_add:
        backend.add_tokens(
            [
                AddedToken(t, special=True)
                if isinstance(t, str)
                else (_with_special(t) if not t.special and t.content in named_contents else t)
                for t in to_add
            ]
        )
    # ... then its _post_init: every special token, as special.
    post_init = [
        t if isinstance(t, AddedToken) else AddedToken(t, special=True, normalized=False)
        for t in [*named.values(), *extra]
    ]
    if post_init:
        backend.add_special_tokens(post_init)


def _chat_template(folder: Path, config: dict) -> str | dict | None:
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, list | tuple):
        return {t["name"]: t["template"] for t in template}
    return template


def _plain(value):
    """What a chat template may see: plain JSON-like data only (as transformers rebuilds it), no objects whose
    methods the sandbox does not know."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=1)
def _environment():
    """The sandbox every template renders in: transformers' own, with its globals and filters."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """{% generation %}...{% endgeneration %} marks the assistant's text for training masks; rendering keeps
        the text as it is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Not jinja2's own tojson, which escapes HTML characters.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:  # dict() without attribute access to the type
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore names: no way to CPython's internals
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
                )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


@functools.lru_cache(maxsize=16)
def _compiled(source: str):
    """A template compiled in the sandbox: the model's chat templates and the gateway's tool prompt."""
    return _environment().from_string(source)


def render_template(source: str, **variables) -> str:
    """Any Jinja template (the gateway's tool prompt) in the chat templates' sandbox, given plain data only."""
    return _compiled(source).render(**_plain(variables))


class TextTokenizer:
    """encode, decode, len() and apply_chat_template as transformers' tokenizer of the same folder answers them,
    plus the special tokens and the chat template that /tokenizer_info shows."""

    def __init__(self, folder: str | os.PathLike):
        folder = Path(folder)
        config, added_tokens = _load_config(folder)
        declared = config.get("tokenizer_class") or "TokenizersBackend"
        # transformers 5 names every *Fast class after its base class, and PreTrainedTokenizerFast is the generic one.
        self.tokenizer_class = "TokenizersBackend" if declared in GENERIC_CLASSES else declared.removesuffix("Fast")
        self.generic = declared in GENERIC_CLASSES

        named, extra = _special_tokens(config, added_tokens)
        self.special_tokens_map = {k: str(v) for k, v in named.items()}

        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        backend.no_truncation()  # transformers encodes without either unless asked
        backend.no_padding()
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.add_bos_token = False  # what transformers reports, having dropped tokenizer_config.json's

        _add_tokens(backend, added_tokens, named, extra)
        if backend.post_processor is None:  # transformers gives it one that adds nothing
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])

        self.backend = backend
        # transformers skips the clean-up (made for WordPiece) on a BPE model unless told it may corrupt the text.
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))
        )
        self.chat_template = _chat_template(folder, config)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens_map.get("unk_token")

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of text. Through encode_batch, which lets go of the GIL while it works (encode holds it for the whole
        text, a second for a megabyte): a gateway tokenizing on a thread keeps its event loop serving. The same ids."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for before, after in (
                (" .", "."),
                (" ?", "?"),
                (" !", "!"),
                (" ,", ","),
                (" ' ", "'"),
                (" n't", "n't"),
                (" 'm", "'m"),
                (" 's", "'s"),
                (" 've", "'ve"),
                (" 're", "'re"),
            ):
                text = text.replace(before, after)
        return text

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template (its tool_use one, where it has several) writes the tools it is given. One that
        does not (SmolLM2's) would drop them: the gateway writes them into the system prompt instead."""
        from jinja2 import meta

        try:
            source = self._template([])
        except ValueError:
            return False
        return "tools" in meta.find_undeclared_variables(_environment().parse(source))

    def _template(self, tools) -> str:
        template = self.chat_template
        if isinstance(template, dict):
            if tools is not None and "tool_use" in template:
                return template["tool_use"]
            if "default" in template:
                return template["default"]
            raise ValueError(f"this model has several chat templates and none is the default: {sorted(template)}")
        if template is None:
            raise ValueError("this model's tokenizer has no chat template")
        return template

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **template_kwargs,
    ) -> list[int] | str:
        """The conversation rendered with the model's chat template, then (tokenize) encoded without adding
        special tokens: the template writes its own."""
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        compiled = _compiled(self._template(tools))
        chat = []
        for message in messages:
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
            # Keys whose value is None are left out: templates handle a missing key, not a literal None.
            message = _plain({k: v for k, v in message.items() if v is not None})
            reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        text = compiled.render(
            messages=chat,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain({**self.special_tokens_map, **template_kwargs}),
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text
