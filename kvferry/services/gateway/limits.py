"""What one request may ask for: the gateway's settings, which the request schema's bounds come from."""

from dataclasses import dataclass

from kvferry.common import settings


@dataclass
class Limits:
    """Each is a gateway setting (defaults from common/settings.py)."""

    max_body_bytes: int = settings.default("max_body_size")
    max_n: int = settings.default("max_n")
    max_tokens: int = settings.default("max_tokens_limit")
    max_stop: int = settings.default("max_stop")
    max_prompts: int = settings.default("max_prompts")  # prompts in one completions request
    max_stop_length: int = settings.default("max_stop_length")  # characters in one stop string
    max_stop_chars: int = settings.default("max_stop_chars")  # characters in all of them together
    max_prompt_chars: int = settings.default("max_prompt_chars")  # characters in the prompts or messages
    max_logprob_entries: int = settings.default("max_logprob_entries")  # in one response (response_size.py)
