"""The gateway's view of its workers: who is live, with what stats, and whom to route to. Pure: it is told about
registrations, heartbeats and the time, and answers questions."""

import itertools
import time
from dataclasses import dataclass, field

from kvferry.common import protocol as p
from kvferry.common import settings
from kvferry.common.gateway_config import GatewayConfig

MISSED_HEARTBEATS = 3  # a worker silent for this many intervals is dropped


@dataclass
class WorkerInfo:
    worker_id: str
    role: p.Role
    identity: bytes
    model: str
    dtype: str
    block_size: int
    num_blocks: int
    max_model_len: int
    kv_address: str
    stats: p.WorkerStats
    last_seen: float
    # Prompt tokens routed here since the last heartbeat: keeps a burst from all landing on one worker.
    pending_prompt_tokens: int = 0
    num_served: int = 0
    draining: bool = False  # shutting down: finishes what it has, gets nothing new
    cached: set[bytes] = field(default_factory=set)  # block hashes in its prefix cache, as it last told us
    quantization: str = "none"
    instance_id: str = ""  # the worker process's: another one under the same id is a restart
    key: str = ""  # with CURVE, the User-Id of the key that registered it: only that key speaks for it

    @property
    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens queued there as it last said, plus those routed to it since."""
        return self.stats.queued_prompt_tokens + self.pending_prompt_tokens

    def num_cached_prefix_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt (its chained block hashes) this worker holds."""
        n = 0
        while n < len(hashes) and hashes[n] in self.cached:
            n += 1
        return n

    def as_json(self) -> dict:
        s = self.stats
        return {
            "id": self.worker_id,
            "role": self.role.name.lower(),
            "model": self.model,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "kv_address": self.kv_address,
            "free_blocks": s.num_free_blocks,
            "running": s.num_running,
            "waiting": s.num_waiting,
            "queued_prompt_tokens": self.num_queued_prompt_tokens,
            "preemptions": s.num_preemptions,
            "protocol_errors": s.num_protocol_errors,
            "prompts_prefilled": s.num_prompts_prefilled,
            "prompt_tokens_computed": s.num_prompt_tokens_computed,
            "prompt_tokens_cached": s.num_prompt_tokens_cached,
            "cached_blocks": s.num_cached_blocks,
            "kv_bytes_sent": s.num_kv_bytes_sent,
            "kv_bytes_skipped": s.num_kv_bytes_skipped,
            "kv_bytes_sent_early": s.num_kv_bytes_sent_early,
            "requests_served": self.num_served,
            "draining": self.draining,
            "last_seen_s_ago": round(time.time() - self.last_seen, 3),
        }


@dataclass
class Registry:
    heartbeat_interval_s: float = GatewayConfig.heartbeat_interval
    expected_model: str | None = None
    expected_block_size: int | None = None
    expected_dtype: str | None = None  # the first worker's, unless set
    workers: dict[str, WorkerInfo] = field(default_factory=dict)

    def register(self, msg: p.Register, identity: bytes, now: float, key: str = "") -> str | None:
        """Admit a worker (registered by the client key `key`); returns the reason it is refused, or None."""
        try:
            role = p.Role(msg.role)
        except ValueError:
            return f"unknown role {msg.role}"
        for what, setting, expected, got in (
            ("model", "model", self.expected_model, msg.model),
            ("block size", "block_size", self.expected_block_size, msg.block_size),
            ("dtype", "dtype", self.expected_dtype or self._live("dtype"), msg.dtype),
            ("quantization", "quantization", self._live("quantization"), msg.quantization),
        ):
            if expected is not None and expected != got:
                return (
                    f"{what} mismatch: the gateway serves {expected!r}, the worker has {got!r}; give every "
                    f"gateway and worker (every pod) the same {settings.label(setting)}"
                )
        if role == p.Role.DECODE and not msg.kv_address:
            return "a decode worker must give its KV ingress address"
        self.workers[msg.worker_id] = WorkerInfo(
            msg.worker_id,
            role,
            identity,
            msg.model,
            msg.dtype,
            msg.block_size,
            msg.num_blocks,
            msg.max_model_len,
            msg.kv_address,
            p.WorkerStats(msg.num_blocks, msg.num_blocks, 0, 0, 0),
            now,
            quantization=msg.quantization,
            instance_id=msg.instance_id,
            key=key,
        )
        return None

    def _live(self, attr: str) -> str | None:
        """The live workers' value of attr (they all agree), or None without any."""
        return next((getattr(w, attr) for w in self.workers.values()), None)

    def heartbeat(self, msg: p.Heartbeat, now: float) -> bool:
        worker = self.workers.get(msg.worker_id)
        if worker is None:
            return False  # expired meanwhile: it must register again
        worker.stats, worker.last_seen, worker.pending_prompt_tokens = msg.stats, now, 0
        return True

    def expire(self, now: float) -> list[WorkerInfo]:
        gone = [w for w in self.workers.values() if now - w.last_seen > MISSED_HEARTBEATS * self.heartbeat_interval_s]
        for w in gone:
            del self.workers[w.worker_id]
        return gone

    def live(self, role: p.Role) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role == role]

    def routable(self, role: p.Role, avoid: frozenset[bytes] = frozenset()) -> list[WorkerInfo]:
        """Live workers of a role that take new work; those in avoid (identities a request failed on) only when
        there is no other."""
        workers = [w for w in self.live(role) if not w.draining]
        return [w for w in workers if w.identity not in avoid] or workers

    def cache_update(self, msg: p.CacheUpdate) -> None:
        worker = self.workers.get(msg.worker_id)
        if worker is None:
            return
        if msg.full:
            worker.cached = set()
        else:
            worker.cached.difference_update(msg.evicted)
        _remember_cached(worker, msg.stored)

    def pick_prefill(
        self, hashes: list[bytes] = (), num_tokens: int = 0, avoid: frozenset[bytes] = frozenset()
    ) -> tuple[WorkerInfo | None, int]:
        """Cache-aware: the prefill worker that would finish this prompt first, counting the prompt tokens queued
        there and the ones of this prompt it does not hold in its prefix cache. hashes: the prompt's chained
        block hashes. Returns the worker and how many of the prompt's leading blocks it holds."""
        best, best_key, best_hits = None, None, 0
        for w in self.routable(p.Role.PREFILL, avoid):
            hits = w.num_cached_prefix_blocks(hashes)
            work = w.num_queued_prompt_tokens + num_tokens - hits * w.block_size
            key = (work, w.num_served)
            if best_key is None or key < best_key:
                best, best_key, best_hits = w, key, hits
        return best, best_hits

    def prefilled(self, worker_id: str, num_prompt_tokens: int) -> None:
        """A prompt routed there is computed: it no longer counts against the worker."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.pending_prompt_tokens = max(0, worker.pending_prompt_tokens - num_prompt_tokens)

    def pick_decode(self, avoid: frozenset[bytes] = frozenset()) -> WorkerInfo | None:
        """The decode worker with the most free KV blocks, then the fewest running sequences."""
        candidates = self.routable(p.Role.DECODE, avoid)
        return min(
            candidates, key=lambda w: (-w.stats.num_free_blocks, w.stats.num_running, w.num_served), default=None
        )

    def assign(
        self, prefill: WorkerInfo, decode: WorkerInfo, num_prompt_tokens: int, num_blocks: int, hashes: list[bytes] = ()
    ) -> None:
        """Count a routed request against both workers until their next heartbeat reports it. The prompt's blocks
        count as cached on the prefill worker at once: a burst sharing a prefix follows the first of it there."""
        prefill.pending_prompt_tokens += num_prompt_tokens
        _remember_cached(prefill, hashes)
        prefill.num_served += 1
        decode.stats.num_free_blocks -= num_blocks
        decode.stats.num_running += 1
        decode.num_served += 1

    def max_model_len(self) -> int | None:
        lens = [w.max_model_len for w in self.workers.values()]
        return min(lens) if lens else None


def _remember_cached(worker: WorkerInfo, hashes) -> None:
    """Add block hashes to what the gateway believes a worker caches, up to twice the blocks it has (it cannot hold
    more; the margin covers hashes counted at routing before the worker reports them). Past that the view is
    stale, not larger, until the worker's next full update replaces it."""
    room = 2 * max(worker.num_blocks, 1) - len(worker.cached)
    if room > 0:
        worker.cached.update(itertools.islice(hashes, room))
