"""The offline simulator: captured arrivals through P prefill and D decode workers, in virtual time.

The workers are the real Scheduler and BlockManager (workers.py), routed to by the gateway's real Registry on the
stale stats their heartbeats carry; a step lasts what the fitted cost model says (docs/architecture.md, "Simulation
and planning", walks a request's life). Contention is approximate: a step's slowdown is set when the running set
changes, and the gateway, KV senders and idle processes take no cores. Left out: message latency, a transfer's
overlap with the prompt's last step (the fitted transfer time is what it adds after), timeouts other than
GIVE_UP_TRANSFER_S, and constraints, penalties and logprobs (they change which tokens come, not how many).
"""

import collections
import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvferry.common import protocol as p
from kvferry.common.block_hash import block_hashes
from kvferry.common.errors import ConfigError, InvalidRequest
from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.sampling import SamplingParams
from kvferry.common.sequence import Sequence
from kvferry.services.gateway.registry import Registry
from kvferry.services.worker_timings import CACHE_SYNC_S, GIVE_UP_TRANSFER_S, RETRY_FULL_AFTER_S
from kvferry.tools.sim.cost_model import CostModel
from kvferry.tools.sim.flights import FlightState, SimChoice, SimFlight, SimRequest
from kvferry.tools.sim.report import Report, build_report
from kvferry.tools.sim.slo import SLO, certainly_over
from kvferry.tools.sim.worker_config import Placement, WorkerConfig
from kvferry.tools.sim.workers import SimWorker
from kvferry.tools.sim.workload import Workload


@dataclass
class SimOptions:
    rate_scale: float = 1.0  # arrivals this many times closer together
    heartbeat_interval_s: float = GatewayConfig.heartbeat_interval
    max_waiting: int = GatewayConfig.max_waiting  # the gateway's; 0: no bound
    stop_on: SLO | None = None  # stop as soon as a p90 certainly misses it, or a request is refused or fails
    on_step: Callable | None = None  # on_step(simulator, worker) as each step starts and ends: for checks


class Simulator:
    def __init__(
        self,
        workload: Workload,
        costs: CostModel,
        config: WorkerConfig,
        placement: Placement,
        num_prefill: int,
        num_decode: int,
        options: SimOptions | None = None,
    ):
        if num_prefill < 1 or num_decode < 1:
            raise ConfigError(f"a stack needs a prefill and a decode worker, got {num_prefill}P+{num_decode}D")
        self.options = options = options or SimOptions()
        if not options.rate_scale > 0:
            raise ConfigError(f"the rate scale must be positive, got {options.rate_scale}")
        self.workload, self.costs, self.config, self.placement = workload, costs, config, placement
        self.block_size = config.block_size
        self.registry = Registry(
            heartbeat_interval_s=options.heartbeat_interval_s, expected_block_size=config.block_size
        )
        self.prefill_workers = [
            SimWorker(f"prefill-{i}", p.Role.PREFILL, config, placement.prefill_threads, costs)
            for i in range(num_prefill)
        ]
        self.decode_workers = [
            SimWorker(f"decode-{i}", p.Role.DECODE, config, placement.decode_threads, costs) for i in range(num_decode)
        ]
        self.workers = {w.worker_id: w for w in self.prefill_workers + self.decode_workers}
        for w in self.workers.values():
            refused = self.registry.register(w.register_message(), w.identity, 0.0)
            assert refused is None, refused
        self.first_token_params = SamplingParams(max_tokens=1)  # the prefill worker runs a prompt for one token
        # (time, order, handler, argument, work): a heap; order keeps equal times first come first served.
        self.events: list = []
        self.num_pending = 0  # events on it that are work, not heartbeats
        self._order = itertools.count()
        self.now = 0.0
        self.running: list[SimWorker] = []  # the workers whose step runs now: they share the cores
        self.requests: list[SimRequest] = []
        self.num_open = len(workload.requests)  # not yet arrived, or not yet finished
        self.num_waiting = 0  # flights routed without their first token: what max_waiting bounds
        self.num_refused = self.num_failed = 0
        self.kv_usage: dict[str, list[tuple[float, int]]] = {w.worker_id: [] for w in self.decode_workers}
        self.cache_sync_at = {w.worker_id: 0.0 for w in self.prefill_workers}
        self.stopped = ""  # why the run stopped early
        self.num_ttft_over = self.num_gaps_over = 0  # against options.stop_on
        self.num_gaps = workload.num_gaps  # if every request is served: what the ITL p90 is of
        self.wall_s = 0.0

    # -- the loop ---------------------------------------------------------------------------------------------
    def run(self) -> Report:
        started = time.perf_counter()
        for spec in self.workload.requests:
            self._push(spec.arrival_s / self.options.rate_scale, self._arrive, spec)
        interval = self.options.heartbeat_interval_s
        everyone = list(self.workers.values())
        for i, w in enumerate(everyone):  # spread over the interval, as processes started apart are
            self._push(interval * (i + 1) / (len(everyone) + 1), self._heartbeat, w, work=False)
        events = self.events
        while events and not self.stopped:
            self.now, _, handler, argument, work = heapq.heappop(events)
            self.num_pending -= work
            handler(argument)
        self.wall_s = time.perf_counter() - started
        return build_report(self)

    def _push(self, at: float, handler, argument, work: bool = True) -> None:
        """work: any event but a heartbeat."""
        heapq.heappush(self.events, (at, next(self._order), handler, argument, work))
        self.num_pending += work

    # -- the gateway ------------------------------------------------------------------------------------------
    def _arrive(self, spec) -> None:
        request = SimRequest(spec, self.now)
        self.requests.append(request)
        max_waiting = self.options.max_waiting
        if max_waiting and self.num_waiting >= max_waiting:
            self._refuse(request, f"429: {max_waiting} requests waiting")
            return
        longest = max(len(ids) for ids in spec.prompts)
        if longest >= self.config.max_model_len:
            self._refuse(request, f"400: a prompt of {longest} tokens, max_model_len {self.config.max_model_len}")
            return
        request.num_open_flights = len(spec.prompts)
        for prompt, outputs in zip(spec.prompts, spec.outputs):
            flight = SimFlight(request, prompt, block_hashes(prompt, self.block_size))
            flight.choices = [SimChoice(flight, ids) for ids in outputs]
            request.flights.append(flight)
            self._route(flight)

    def _route(self, flight: SimFlight) -> None:
        """GatewayCore._dispatch: pick both workers, count the prompt against them, send it to the prefill one."""
        tokens, hashes = flight.prompt_token_ids, flight.block_hashes
        prefill, num_cached_blocks = self.registry.pick_prefill(hashes, len(tokens))
        decode = self.registry.pick_decode()
        flight.pending_prompt_tokens = len(tokens) - num_cached_blocks * self.block_size
        self.registry.assign(prefill, decode, flight.pending_prompt_tokens, -(-len(tokens) // self.block_size), hashes)
        flight.prefill, flight.decode = self.workers[prefill.worker_id], self.workers[decode.worker_id]
        flight.prefill_seq = Sequence(flight, tokens, self.first_token_params, block_hashes=hashes)
        flight.prefill.scheduler.add(flight.prefill_seq)
        self.num_waiting += 1
        self._kick(flight.prefill)

    def _refuse(self, request: SimRequest, why: str) -> None:
        request.refuse(self.now, why)
        self.num_refused += 1
        self.num_open -= 1
        if self.options.stop_on is not None:
            self.stopped = f"request {request.spec.request_id} refused ({why})"

    def _heartbeat(self, w: SimWorker) -> None:
        if self.num_open == 0:
            return  # every request is done: the run ends with the heartbeats
        if not w.busy:  # an idle loop refreshes its stats every half interval too
            w.snapshot_if_due(self.now, self.options.heartbeat_interval_s / 2, self._routes_on_queue(w))
        self.registry.heartbeat(w.heartbeat(), self.now)
        if not w.is_prefill:
            self.kv_usage[w.worker_id].append((self.now, w.block_manager.num_used_blocks))
            w.block_manager.take_cache_events()  # nobody routes on a decode worker's cache: only drop them
        if self.num_pending == 0:
            self._stuck()
        self._push(self.now + self.options.heartbeat_interval_s, self._heartbeat, w, work=False)

    def _stuck(self) -> None:
        """Requests are open and only heartbeats are left: start any worker that can step (the real loop keeps
        trying); if none can, the simulation cannot finish, which is a bug."""
        for w in self.workers.values():
            self._kick(w)
        if self.num_pending == 0:
            open_ids = [r.spec.request_id for r in self.requests if r.finished_at is None]
            raise AssertionError(f"the simulation is stuck at {self.now:.3f} s with requests open: {open_ids[:5]}")

    def _routes_on_queue(self, w: SimWorker) -> bool:
        """Whether the gateway reads the worker's queued prompt tokens: only to choose between prefill workers."""
        return w.is_prefill and len(self.prefill_workers) > 1

    def _send_cache_updates(self, w: SimWorker) -> None:
        """Worker.send_cache_updates, after each step: what the prefix cache stored and evicted, now and then all."""
        stored, evicted = w.block_manager.take_cache_events()
        if self.now >= self.cache_sync_at[w.worker_id]:
            self.registry.cache_update(p.CacheUpdate(w.worker_id, list(w.block_manager.cached), full=True))
            self.cache_sync_at[w.worker_id] = self.now + CACHE_SYNC_S
        elif stored or evicted:
            self.registry.cache_update(p.CacheUpdate(w.worker_id, stored, evicted))

    # -- steps ------------------------------------------------------------------------------------------------
    def _kick(self, w: SimWorker) -> None:
        """Start the worker's next step if it is idle and has one."""
        if w.busy:
            return
        plan = w.scheduler.schedule()
        while not plan.chunks and plan.preempted:  # it preempted its last running sequence: recompute it now
            plan = w.scheduler.schedule()
        if not plan.chunks:
            return  # kicked again when blocks free up, as the real loop, which keeps trying, would find
        w.busy, w.plan, w.step_started = True, plan, self.now
        w.work_left, w.pace = w.step_seconds(plan), 0.0
        w.num_steps += 1
        if w.is_prefill:
            for chunk in plan.chunks:
                flight = chunk.seq.request_id
                if flight.state is FlightState.QUEUED:
                    flight.start(self.now)
                    self._hold_cached_blocks(flight)
        if self.options.on_step is not None:
            self.options.on_step(self, w)
        self.running.append(w)
        self._share_cores()

    def _share_cores(self) -> None:
        """The running steps changed: each goes on at the pace the new set allows, its end moved to match (the old
        end events stay on the heap, told apart by their version)."""
        busy_threads = sum(r.threads for r in self.running) + self.placement.background_threads
        widths = collections.Counter(r.threads for r in self.running)
        for r in self.running:
            if r.pace:
                r.work_left = max(0.0, r.work_left - (self.now - r.paced_since) / r.pace)
            others = [t for t, n in widths.items() if n - (t == r.threads) > 0]
            r.pace = self.costs.slowdown(r.threads, busy_threads, self.placement.cores, max(others, default=1))
            r.paced_since = self.now
            r.step_version += 1
            self._push(self.now + r.work_left * r.pace, self._step_done, (r, r.step_version))

    def _step_done(self, done) -> None:
        w, version = done
        if version != w.step_version:
            return  # an end that contention moved later
        plan, w.plan = w.plan, None
        w.busy = False
        w.busy_s += self.now - w.step_started
        self.running.remove(w)
        self._share_cores()
        if w.is_prefill:
            sampled = [c.seq.request_id.choices[0].token_at(0) if c.samples else None for c in plan.chunks]
            for seq in w.scheduler.update(plan, sampled):
                self._prefilled(seq.request_id)
            self._send_cache_updates(w)
        else:
            self._decoded(w, plan)
        w.snapshot_if_due(self.now, self.options.heartbeat_interval_s / 2, self._routes_on_queue(w))
        if self.options.on_step is not None:
            self.options.on_step(self, w)
        self._kick(w)

    def _decoded(self, w: SimWorker, plan) -> None:
        """A decode worker's step ended: a token for each choice that sampled (a recompute's last chunk too)."""
        now, sampled = self.now, []
        bound = self.options.stop_on.itl_p90_s if self.options.stop_on is not None else math.inf
        recompute = plan.is_prefill  # after a preemption: only a prompt's last chunk samples (a decode chunk always)
        for chunk in plan.chunks:
            if recompute and not chunk.samples:
                sampled.append(None)
                continue
            seq = chunk.seq
            choice = seq.request_id
            sampled.append(choice.token_at(len(seq.output_token_ids)))
            gap = now - choice.last_token_at
            choice.gaps.append(gap)
            choice.last_token_at = now
            if gap > bound:
                self.num_gaps_over += 1
        for seq in w.scheduler.update(plan, sampled):
            choice = seq.request_id
            w.received.forget(choice)
            if choice.flight.choice_finished(choice, now):
                self._end_flight(choice.flight)
        if self.num_gaps_over and certainly_over(self.num_gaps_over, self.num_gaps, self.options.stop_on.quantile):
            self.stopped = f"ITL p90 over {bound} s"
        self._retry_transfers_soon(w)

    # -- prefill to decode ------------------------------------------------------------------------------------
    def _hold_cached_blocks(self, flight: SimFlight) -> None:
        """The KVQuery: the decode worker holds the prompt's leading cached blocks until the transfer skips them."""
        d = flight.decode
        if d.block_manager.enable_caching:
            num = d.block_manager.num_cacheable_blocks(len(flight.prompt_token_ids))
            flight.held = d.received.hold_prefix(flight.block_hashes[:num])

    def _prefilled(self, flight: SimFlight) -> None:
        request = flight.request
        first_of_request = request.first_token_at is None
        # Each choice runs for its captured length, as with ignore_eos; the prefill worker judges its first token by
        # the request's own parameters (a choice at max_model_len ends there too).
        params = [SamplingParams(max_tokens=c.length, ignore_eos=True) for c in flight.choices]
        num_tokens, judge = len(flight.prompt_token_ids) + 1, flight.prefill.scheduler.finish_reason
        going_on = flight.first_tokens(
            self.now, params, lambda c, choice_params: judge(choice_params, c.token_at(0), 1, num_tokens) is not None
        )
        self.num_waiting -= 1
        self.registry.prefilled(flight.prefill.worker_id, flight.pending_prompt_tokens)  # the FirstToken
        stop = self.options.stop_on
        if stop is not None and first_of_request and self.now - request.arrival > stop.ttft_p90_s:
            self.num_ttft_over += 1
            if certainly_over(self.num_ttft_over, len(self.workload.requests), stop.quantile):
                self.stopped = f"TTFT p90 over {stop.ttft_p90_s} s"
        if not going_on:  # every choice ended at its first token: nothing to ship
            self._let_go(flight)
            self._end_flight(flight)
            return
        if not self._try_transfer(flight):
            self._wait_for_room(flight)

    def _try_transfer(self, flight: SimFlight) -> bool:
        """Offer the KV to the decode worker; False when it has no room now (the flight waits to try again)."""
        d = flight.decode
        if self.now > flight.first_token_at + GIVE_UP_TRANSFER_S:
            self._fail(flight, f"{d.worker_id} did not take the KV in {GIVE_UP_TRANSFER_S:.0f} s")
            return True
        try:
            blocks = d.received.reserve(flight.going_on, flight.prompt_token_ids, flight.params, (), flight.held)
        except InvalidRequest as exc:  # more than the decode worker can ever hold
            self._fail(flight, f"{d.worker_id} refused the KV: {exc}")
            return True
        if blocks is None:
            return False
        flight.blocks = blocks
        sender = flight.prefill
        start = max(self.now, sender.sender_free_at)
        sender.sender_free_at = start + self.costs.transfer_seconds(len(blocks))
        self._push(sender.sender_free_at, self._transferred, flight)
        return True

    def _transferred(self, flight: SimFlight) -> None:
        """The last layer group is in: admit the choices (DecodeWorker.admit), or put the transfer back."""
        d = flight.decode
        choices = flight.going_on
        first_tokens = [c.token_at(0) for c in choices]
        if not d.received.admit_prefilled(
            choices, flight.prompt_token_ids, first_tokens, flight.params, flight.blocks, (), flight.held
        ):
            d.block_manager.free(flight.blocks)  # DecodeAttempt.put_back: the held blocks stay held
            flight.blocks = []
            self._wait_for_room(flight)
            self._kick(d)  # a preempted sequence may fit in what was freed
            return
        for choice in choices:
            choice.seq = d.received.sequence(choice)
        flight.admitted()
        self._release_prefill(flight)
        self._kick(d)

    def _wait_for_room(self, flight: SimFlight) -> None:
        flight.retry_from = self.now
        flight.decode.waiting_transfers.append(flight)
        self._retry_transfers_soon(flight.decode)

    def _retry_transfers_soon(self, d: SimWorker) -> None:
        """Try the first waiting transfer again at its sender's next retry time (one retry pending per worker)."""
        if d.retry_pending or not d.waiting_transfers:
            return
        head = d.waiting_transfers[0]
        periods = max(1, math.ceil((self.now - head.retry_from) / RETRY_FULL_AFTER_S - 1e-9))
        d.retry_pending = True
        self._push(head.retry_from + periods * RETRY_FULL_AFTER_S, self._retry_transfers, d)

    def _retry_transfers(self, d: SimWorker) -> None:
        d.retry_pending = False
        while d.waiting_transfers:
            if not self._try_transfer(d.waiting_transfers[0]):
                if not d.busy:  # no step will end to free room: ask again after the period, as the sender does
                    d.retry_pending = True
                    self._push(self.now + RETRY_FULL_AFTER_S, self._retry_transfers, d)
                return
            d.waiting_transfers.popleft()

    def _release_prefill(self, flight: SimFlight) -> None:
        flight.prefill.scheduler.release(flight.prefill_seq)
        self._kick(flight.prefill)

    def _let_go(self, flight: SimFlight) -> None:
        """Nothing ships: free the prefill worker's blocks and the decode worker's held ones."""
        self._release_prefill(flight)
        if flight.held:
            flight.decode.block_manager.free(flight.held)
            flight.held = []
            self._kick(flight.decode)

    def _fail(self, flight: SimFlight, why: str) -> None:
        self._let_go(flight)
        self.num_failed += not flight.request.error  # requests, not their flights
        self._end_flight(flight, why)
        if self.options.stop_on is not None:
            self.stopped = f"request {flight.request.spec.request_id} failed ({why})"

    def _end_flight(self, flight: SimFlight, error: str = "") -> None:
        flight.end(self.now, error)
        if flight.request.finished_at is not None:
            self.num_open -= 1
