"""A simulated worker: the real Scheduler and BlockManager, built as the real worker builds them, plus what the
simulator keeps about its process (threads, the running step, the stats its heartbeats carry). A prefill worker
keeps a finished prompt's blocks (keep_finished_blocks, as PrefillConnector asks) until the transfer is taken.
"""

import dataclasses
from collections import deque

from kvferry.common import protocol as p
from kvferry.common.block_manager import BlockManager
from kvferry.common.scheduler import Scheduler, StepPlan
from kvferry.tools.sim.cost_model import CostModel
from kvferry.tools.sim.received import SimReceivedKV
from kvferry.tools.sim.worker_config import WorkerConfig

SIM_MODEL, SIM_DTYPE = "simulated", "float32"  # what the workers register with: the registry only compares them


class SimWorker:
    def __init__(self, worker_id: str, role: p.Role, config: WorkerConfig, threads: int, costs: CostModel):
        self.worker_id, self.role, self.threads = worker_id, role, threads
        self.identity = worker_id.encode()
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            keep_finished_blocks=role == p.Role.PREFILL,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_threshold=config.long_prefill_threshold,
        )
        self.received = SimReceivedKV(self.scheduler) if role == p.Role.DECODE else None
        self.costs = costs.costs(threads)  # the fitted figures at this thread count (or the nearest measured)
        self.busy = False  # a step is running
        self.plan = None  # the running step's
        self.step_started = 0.0
        self.work_left = 0.0  # seconds the running step still takes alone, as of paced_since
        self.pace = 0.0  # how many times slower than alone it runs now (contention)
        self.paced_since = 0.0
        self.step_version = 0  # its end events: only the latest counts
        self.num_steps = 0
        self.busy_s = 0.0
        # Its stats as of its latest snapshot: the real loop refreshes them after a step once half a heartbeat
        # interval passed, and the heartbeat thread sends whatever the latest is.
        self.latest_stats = self.stats()
        self.stats_due = 0.0
        # Prefill: its KV sender, one thread that sends one transfer after another.
        self.sender_free_at = 0.0
        # Decode: transfers that found no room, oldest first, and whether a retry of the first is due.
        self.waiting_transfers: deque = deque()
        self.retry_pending = False

    @property
    def is_prefill(self) -> bool:
        return self.role == p.Role.PREFILL

    def register_message(self) -> p.Register:
        return p.Register(
            role=int(self.role),
            worker_id=self.worker_id,
            model=SIM_MODEL,
            dtype=SIM_DTYPE,
            block_size=self.block_manager.block_size,
            num_blocks=self.block_manager.num_blocks,
            max_model_len=self.scheduler.max_model_len,
            kv_address=f"sim://{self.worker_id}" if self.role == p.Role.DECODE else "",
        )

    def step_seconds(self, plan: StepPlan) -> float:
        """The plan's time alone on its threads. cost_model.attention_pairs is written out: this runs every step."""
        chunks = plan.chunks
        if plan.is_prefill:
            pairs = context = 0
            for c in chunks:
                n, before = c.num_new_tokens, c.seq.num_computed_tokens
                pairs += n * before + n * (n + 1) // 2
                context += before + n
            return self.costs.prefill.seconds(plan.num_tokens, len(chunks), pairs, context)
        context = len(chunks) + sum(c.seq.num_computed_tokens for c in chunks)  # one new token each: pairs = context
        return self.costs.decode.seconds(len(chunks), len(chunks), context, context)

    def stats(self, with_queue: bool = True) -> p.WorkerStats:
        """LLMEngine.stats as the heartbeat carries it; with_queue False skips the walk over the waiting prompts
        where no routing decision reads their tokens."""
        sch, bm = self.scheduler, self.block_manager
        return p.WorkerStats(
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_running=len(sch.running),
            num_waiting=len(sch.waiting),
            queued_prompt_tokens=sch.queued_prompt_tokens() if with_queue else 0,
            num_preemptions=sch.num_preemptions,
            num_prompt_tokens_computed=sch.num_computed_prompt_tokens,
            num_prompt_tokens_cached=sch.num_cached_prompt_tokens,
            num_cached_blocks=bm.num_cached_blocks,
        )

    def snapshot_if_due(self, now: float, half_interval_s: float, with_queue: bool) -> None:
        if now >= self.stats_due:
            self.latest_stats, self.stats_due = self.stats(with_queue), now + half_interval_s

    def heartbeat(self) -> p.Heartbeat:
        # A copy: the registry changes what it holds as it routes (assign), and each real heartbeat is a fresh message.
        return p.Heartbeat(self.worker_id, dataclasses.replace(self.latest_stats))
