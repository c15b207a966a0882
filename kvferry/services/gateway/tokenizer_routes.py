"""The tokenizer over HTTP, as vLLM serves it: /tokenize, /detokenize and /tokenizer_info.

lm-evaluation-harness's `local-completions` finds these and then tokenizes through the server
instead of downloading the tokenizer.
"""

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvferry.services.gateway.request_parsing import ApiError, field
from kvferry.services.gateway.responses import text_of


class TokenizerRoutes:
    def __init__(self, api, tokenizer):
        self.api, self.tokenizer = api, tokenizer

    def chat_ids(self, messages, add_generation_prompt: bool = True) -> list[int]:
        if isinstance(messages, list):
            messages = [dict(m, content=text_of(m.get("content"))) if isinstance(m, dict) else m for m in messages]
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} with text content", "messages")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # a template that rejects the conversation
            raise ApiError(400, f"the chat template rejected the messages: {exc}", "messages") from None
        return list(ids)

    async def tokenize(self, request: Request) -> JSONResponse:
        try:
            body = await self.api.json_body(request)
            if "messages" in body:
                ids = self.chat_ids(body["messages"], field(body, "add_generation_prompt", (bool,), True))
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise ApiError(400, "'prompt' must be a string (or send 'messages')", "prompt")
                ids = self.tokenizer.encode(prompt, add_special_tokens=field(body, "add_special_tokens", (bool,), True))
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return JSONResponse(
            {"count": len(ids), "max_model_len": self.api.max_model_len, "tokens": ids, "token_strs": None}
        )

    async def detokenize(self, request: Request) -> JSONResponse:
        try:
            body = await self.api.json_body(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.api.vocab_size for t in tokens
            ):
                raise ApiError(400, f"'tokens' must be a list of token ids in [0, {self.api.vocab_size})", "tokens")
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return JSONResponse({"prompt": self.tokenizer.decode(tokens)})

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
