"""Per-request sampling parameters, validated where they enter the engine."""
import math
from dataclasses import dataclass

from kvferry.common.errors import InvalidRequest


GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k cut
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequest(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf; it is argmax in all but name.
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1
