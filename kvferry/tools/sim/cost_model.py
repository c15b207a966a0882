"""What a step costs on the machine being planned for: fitted by `kvferry bench costs`, read by the simulator.

A step's time is linear in a fixed part (every layer's dispatch, the Python around the step), tokens (the GEMMs),
sequences (sampling, attention launches), attention pairs and context tokens read (the CPU's paged attention
gathers each sequence's whole context in every layer, so a late short chunk costs more than its pairs say).
Prefill and decode steps take different paths through the model and are fitted apart, per torch thread count,
since on a shared machine the placement decides how many cores a worker really gets. A KV transfer costs a fixed
part plus a part per block.

Past one busy thread per core, processes slow each other by more than a fair share (each parallel region waits
for its slowest thread, and a waiting thread spins on a core another process needs), so the slowdown is measured
per (own threads, widest other busy process's threads) at a few loads and interpolated; where nothing was
measured it is the fair share, busy threads per core.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

COST_MODEL_VERSION = 1


def attention_pairs(num_computed: int, num_new: int) -> int:
    """Query-key pairs of a chunk of num_new tokens after num_computed: each attends to all before it and itself."""
    return num_new * num_computed + num_new * (num_new + 1) // 2


def interpolate(points: list[list[float]], x: float) -> float:
    """Piecewise linear through (x, y) points sorted by x; past the last, the last segment's slope goes on."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1 or (x1, y1) == tuple(points[-1]):
            return max(1.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0)) if x1 > x0 else y1
    return points[-1][1]


@dataclass
class StepCost:
    """seconds = fixed_s + per_token_s * tokens + per_seq_s * seqs + per_pair_s * pairs + per_context_s * context,
    where context sums each chunk's computed and new tokens."""

    fixed_s: float
    per_token_s: float
    per_seq_s: float
    per_pair_s: float
    per_context_s: float = 0.0

    def seconds(self, tokens: int, seqs: int, pairs: int, context: int = 0) -> float:
        return (
            self.fixed_s
            + self.per_token_s * tokens
            + self.per_seq_s * seqs
            + self.per_pair_s * pairs
            + self.per_context_s * context
        )


@dataclass
class ThreadCosts:
    prefill: StepCost
    decode: StepCost


@dataclass
class CostModel:
    threads: dict[int, ThreadCosts]  # torch threads of the worker -> its step costs
    kv_transfer_fixed_s: float = 0.0  # one transfer's own cost, whatever its size
    kv_transfer_per_block_s: float = 0.0
    cores: int = 1  # of the machine it was measured on
    block_size: int = 16
    machine: str = ""  # a description: CPU model, GPU
    model: str = ""
    measured_at: str = ""  # ISO date
    notes: dict = field(default_factory=dict)  # the fit's residuals and what was measured, for the record
    # "own threads/widest other's threads" -> [[busy threads per core, slowdown], ...], by load
    contention: dict[str, list[list[float]]] = field(default_factory=dict)
    version: int = COST_MODEL_VERSION

    def nearest_threads(self, threads: int) -> int:
        """The thread count measured nearest to this one (the fewer, on a tie)."""
        return min(self.threads, key=lambda t: (abs(t - threads), t))

    def costs(self, threads: int) -> ThreadCosts:
        return self.threads[self.nearest_threads(threads)]

    def step_seconds(self, prefill: bool, threads: int, tokens: int, seqs: int, pairs: int, context: int = 0) -> float:
        costs = self.costs(threads)
        return (costs.prefill if prefill else costs.decode).seconds(tokens, seqs, pairs, context)

    def slowdown(self, threads: int, busy_threads: int, cores: int, widest_other: int = 1) -> float:
        """How much longer a step of a worker with this many threads takes while busy_threads (its own included)
        run on the machine's cores, the widest other busy process having widest_other threads; cores 0: every
        worker has cores of its own."""
        load = busy_threads / cores if cores > 0 else 0.0
        if load <= 1.0:
            return 1.0
        if not self.contention:
            return load
        pairs = {tuple(int(x) for x in key.split("/")): value for key, value in self.contention.items()}
        nearest = min(pairs, key=lambda p: (abs(p[0] - threads), abs(p[1] - widest_other), p))
        return interpolate([[1.0, 1.0], *sorted(pairs[nearest])], load)

    def transfer_seconds(self, num_blocks: int) -> float:
        return self.kv_transfer_fixed_s + self.kv_transfer_per_block_s * num_blocks

    def to_json(self) -> dict:
        out = asdict(self)
        out["threads"] = {str(t): asdict(c) for t, c in self.threads.items()}
        return out

    @classmethod
    def from_json(cls, raw: dict) -> "CostModel":
        if raw.get("version") != COST_MODEL_VERSION:
            raise ValueError(
                f"cost model version {raw.get('version')!r}; this kvferry reads version {COST_MODEL_VERSION} "
                "(fit it again with kvferry bench costs)"
            )
        threads = {
            int(t): ThreadCosts(StepCost(**c["prefill"]), StepCost(**c["decode"])) for t, c in raw["threads"].items()
        }
        if not threads:
            raise ValueError("the cost model has no thread count measured")
        return cls(**{**raw, "threads": threads})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a kvferry cost model: {exc}") from None
