"""The tokenizer over HTTP, as vLLM serves it (lm-evaluation-harness's `local-completions` tokenizes through it):
/tokenize, /detokenize and /tokenizer_info; and the tokenizing the completion routes share with them. Tokenizing runs
on the API's text threads, within --max-prompt-chars, checked first; a request is let in as a generation is.
"""

import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.chat_messages import checked_messages
from kvferry.services.gateway.request_fields import TOKENIZE, schema_of
from kvferry.services.gateway.tool_prompt import for_template
from kvferry.services.gateway.tools import Tools, parse_tools


def text_chars(value) -> int:
    """The characters of every string in messages: their content, and every other field the template may write."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(text_chars(v) for v in value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    return 0


class TokenizerRoutes:
    def __init__(self, api, tokenizer):
        self.api, self.tokenizer = api, tokenizer

    def check_chars(self, num_chars: int, param: str, how: str = "") -> None:
        """--max-prompt-chars, checked before tokenizing."""
        most = self.api.config.max_prompt_chars
        if num_chars > most:
            raise ApiError(
                400,
                f"{num_chars} characters in '{param}'{how}, over this server's limit of {most} characters",
                param,
            )

    def chat_ids(self, messages, add_generation_prompt: bool = True, tools: Tools | None = None) -> list[int]:
        """The conversation, with the tools it may call, through the chat template, as token ids (on a text thread)."""
        messages = checked_messages(messages)
        self.check_chars(text_chars(messages) + text_chars(tools.definitions if tools else []), "messages")
        messages, shown = for_template(messages, tools, self.tokenizer.renders_tools, self.api.tool_prompt)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=shown, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # a template that rejects the conversation
            raise ApiError(400, f"the chat template rejected the messages: {exc}", "messages") from None
        # Checked again as rendered: many short messages put far more of the template's own text around them.
        self.check_chars(len(text), "messages", " through the chat template")
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template writes the special tokens

    async def tokenize(self, request: Request) -> JSONResponse:
        body = await self.api.json_body(request)
        values = schema_of(TOKENIZE, self.api.config).read(body, self.api.vocab_size)
        if "messages" in body:
            deadline = time.monotonic() + self.api.core.deadlines.request_s
            checks = body.get("tools") is not None
            tools = await self.api.checks_off_loop(request, deadline, parse_tools, body, checks=checks)
            ids = await self.api.off_loop(self.chat_ids, body["messages"], values["add_generation_prompt"], tools)
        else:
            prompt = values["prompt"]
            if prompt is None:
                raise ApiError(400, "'prompt' must be a string (or send 'messages')", "prompt")
            self.check_chars(len(prompt), "prompt")
            ids = await self.api.off_loop(self.tokenizer.encode, prompt, values["add_special_tokens"])
        return JSONResponse(
            {"count": len(ids), "max_model_len": self.api.max_model_len, "tokens": ids, "token_strs": None}
        )

    async def detokenize(self, request: Request) -> JSONResponse:
        most, vocab_size = self.api.model_max_len, self.api.vocab_size  # no prompt nor completion is longer
        tokens = (await self.api.json_body(request)).get("tokens")
        if isinstance(tokens, list) and len(tokens) > most:
            raise ApiError(400, f"'tokens' may hold at most {most} token ids, the model's context length", "tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in tokens
        ):
            raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab_size})", "tokens")
        return JSONResponse({"prompt": await self.api.off_loop(self.tokenizer.decode, tokens)})

    async def tokenizer_info(self, request: Request) -> JSONResponse:
        t = self.tokenizer
        return JSONResponse(
            {
                "tokenizer_class": t.tokenizer_class,
                "vocab_size": self.api.vocab_size,
                "model_max_length": self.api.max_model_len,
                "eos_token": t.eos_token,
                "bos_token": t.bos_token,
                "pad_token": t.pad_token,
                "unk_token": t.unk_token,
                "add_bos_token": t.add_bos_token,
                "chat_template": t.chat_template,
            }
        )
