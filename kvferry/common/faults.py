"""Fault injection for tests: KVFERRY_FAULTS makes the transport drop, duplicate and delay messages, and a worker
stall or fail, e.g. KVFERRY_FAULTS="drop=0.02,dup=0.02,delay_ms=5,seed=7". Unset, nothing here runs on the send path.

- drop, dup: the chance that a sent message never leaves, or leaves twice (the receiver must ignore the copy);
- delay_ms: each message waits up to this long before it leaves;
- seed: the same seed gives the same faults for the same sequence of sends on a channel;
- stall_after_steps, stall_s: a worker's step loop sleeps stall_s once, after that many steps (a stuck engine in a
  live process);
- fail_step: the engine's step of that number (from 1) raises inside its compute, as a kernel error would (its
  requests fail; the process must live);
- step_delay_ms: a worker's step loop sleeps this long after every step (a slow model, for a tiny-model test).
"""

import os
import random
import zlib
from dataclasses import dataclass

from kvferry.common.errors import ConfigError

ENV = "KVFERRY_FAULTS"


@dataclass(frozen=True)
class FaultSpec:
    drop: float = 0.0
    dup: float = 0.0
    delay_ms: float = 0.0
    seed: int = 0
    stall_after_steps: int = 0
    stall_s: float = 0.0
    fail_step: int = 0
    step_delay_ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        values = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, raw = item.partition("=")
            name = name.strip()
            if not sep or name not in cls.__dataclass_fields__:
                raise ConfigError(
                    f"{ENV}: {item!r} is not one of {', '.join(n + '=' for n in cls.__dataclass_fields__)}"
                )
            kind = int if name in ("seed", "stall_after_steps", "fail_step") else float
            try:
                values[name] = kind(raw)
            except ValueError:
                raise ConfigError(f"{ENV}: {name} must be a {kind.__name__}, got {raw!r}") from None
        spec = cls(**values)
        if not (0 <= spec.drop <= 1 and 0 <= spec.dup <= 1) or min(spec.delay_ms, spec.stall_s, spec.step_delay_ms) < 0:
            raise ConfigError(
                f"{ENV}: drop and dup are chances in [0, 1]; delay_ms, stall_s and step_delay_ms are not negative"
            )
        return spec

    @property
    def touches_messages(self) -> bool:
        return bool(self.drop or self.dup or self.delay_ms)


def from_env() -> FaultSpec | None:
    text = os.environ.get(ENV, "").strip()
    return FaultSpec.parse(text) if text else None


class MessageFaults:
    """One channel's faults: its own random stream, seeded by the spec's seed and the channel's name, so that
    channels do not disturb each other's draws."""

    def __init__(self, spec: FaultSpec, channel_name: str):
        self.spec = spec
        self.rng = random.Random(spec.seed * 1_000_003 + zlib.crc32(channel_name.encode()))
        self.num_dropped = self.num_duplicated = 0

    def plan(self) -> tuple[int, float]:
        """-> (copies to send: 0, 1 or 2; seconds to wait first). Always three draws, so that the stream of
        faults depends only on the number of sends."""
        drop, dup, delay = self.rng.random(), self.rng.random(), self.rng.random()
        if drop < self.spec.drop:
            self.num_dropped += 1
            return 0, 0.0
        copies = 2 if dup < self.spec.dup else 1
        self.num_duplicated += copies - 1
        return copies, delay * self.spec.delay_ms / 1000
