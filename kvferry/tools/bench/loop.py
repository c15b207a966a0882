"""`kvferry bench step --measure loop`: the decode worker's own loop, measured in process around a forward pass that
costs little (a tiny model: `--model DIR`).

A real DecodeWorker runs its real loop (Worker.serve_forever): this module plays its gateway (a ROUTER socket that
answers the registration as a gateway that takes TokenBatch, then lets a step's tokens pile up, unread while the loop
runs: one TokenBatch a step, as production sends them) and its prefill
worker (one KVTransfer per request, zero KV, admitted before the timing starts). Every forward pass (the model and
its logits, or a decode graph's run) is timed; the rest of the time between two forward passes is the loop's:
scheduling, the step's tensors, sampling, the engine's bookkeeping, the Tokens messages (timed apart too), the
loop's own turn; by the wall, and by the loop thread's CPU time. The process's CPU time (all its threads: ZeroMQ's,
OpenMP's, the heartbeat's) is read at the first and the last measured forward.
"""

import contextlib
import cProfile
import io
import pstats
import random
import statistics
import sys
import time
import uuid

import torch
import zmq

from kvferry.common import protocol as p
from kvferry.common.errors import ConfigError
from kvferry.common.sampling import SamplingParams
from kvferry.common.transport import Channel
from kvferry.common.worker_config import WorkerConfig
from kvferry.tools.bench import workload

# --sampling: each sequence's parameters (seed: its index). "sampled" is the benchmark workloads' sampled twin;
# "temperature" has no top_p. A tiny random model's distributions are nearly flat: a top_p of 0.95 keeps most of
# the vocabulary, the case that once needed a full sort (sampler.py draws it by tries now).
SAMPLINGS = {
    "greedy": workload.GREEDY,
    "temperature": workload.SAMPLED["std-32-t0.8"][1],
    "sampled": workload.SAMPLED["std-32-t0.8-top-p0.95"][1],
    "penalized": {
        **workload.SAMPLED["std-32-t0.8-top-p0.95"][1],
        **dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.2),
    },
}
WARMUP_STEPS = 3


def sampling_params(mode: str, index: int, max_tokens: int) -> SamplingParams:
    fields = SAMPLINGS[mode]
    seed = None if fields["temperature"] == 0 else index
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed, **fields)


def _now() -> tuple[float, float]:
    """(wall, this thread's CPU) seconds. The thread's CPU time is robust where the wall is not: on a machine whose
    cores are shared, a preempted loop waits, but it does not run."""
    return time.perf_counter(), time.thread_time()


class ForwardClock:
    """Wraps the runner's forward calls (the model and its logits, or a decode graph's run): at each forward's start
    it records the time, and it adds up each forward's own time. On CUDA each call is waited for, so that its span
    is the device's."""

    def __init__(self, runner, on_forward):
        self.runner, self.on_forward = runner, on_forward
        self.cuda = torch.device(runner.device).type == "cuda"
        self.starts: list[tuple[float, float]] = []  # _now() at each forward's start
        self.forwards: list[list[float]] = []  # each forward's [wall, thread CPU], its model and logits together
        self.model = runner.model
        self.graphs = runner.decode_graphs

    def install(self) -> None:
        clock, model = self, self.model

        class Timed:
            def __call__(self, *args):
                clock.start(args[0].shape[0])
                return clock.timed(model, *args)

            def compute_logits(self, hidden):
                return clock.timed(model.compute_logits, hidden)

            def __getattr__(self, name):
                return getattr(model, name)

        self.runner.model = Timed()
        if self.graphs is not None:
            graph_run = self.graphs.run

            def run(*args):
                clock.start(args[0].shape[0])
                return clock.timed(graph_run, *args)

            self.graphs.run = run

    def uninstall(self) -> None:
        self.runner.model = self.model
        if self.graphs is not None:
            del self.graphs.run  # the instance attribute: the method again

    def start(self, num_rows: int) -> None:
        self.starts.append(_now())
        self.forwards.append([0.0, 0.0])
        self.on_forward(num_rows)

    def timed(self, fn, *args):
        wall, cpu = _now()
        try:
            return fn(*args)
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            now_wall, now_cpu = _now()
            self.forwards[-1][0] += now_wall - wall
            self.forwards[-1][1] += now_cpu - cpu


@contextlib.contextmanager
def spans_of(owner, name: str):
    """Each call of owner.name while inside, as (wall, thread CPU) seconds, in a list."""
    method, spans = getattr(owner, name), []

    def timed(*args, **kwargs):
        wall, cpu = _now()
        try:
            return method(*args, **kwargs)
        finally:
            now_wall, now_cpu = _now()
            spans.append((now_wall - wall, now_cpu - cpu))

    setattr(owner, name, timed)
    try:
        yield spans
    finally:
        delattr(owner, name)  # the instance attribute: the method again


class Peers:
    """The worker's gateway (a ROUTER it registers with) and its prefill worker (a DEALER on its KV ingress)."""

    def __init__(self):
        ctx = zmq.Context.instance()
        self.gateway = ctx.socket(zmq.ROUTER)
        self.gateway.setsockopt(zmq.LINGER, 0)
        self.gateway.setsockopt(zmq.RCVHWM, 0)  # unread while the loop runs: every Tokens message is kept
        port = self.gateway.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.gateway_channel = Channel(self.gateway, "bench/gateway")
        self.prefill = None
        self.prefill_channel = None

    def register(self, worker) -> None:
        """The registration handshake, as a gateway answers it."""
        link = worker.links[0]
        link.register_if_due(worker.register_message(), time.monotonic())
        if not self.gateway.poll(30_000):
            raise RuntimeError("the worker did not register")
        peer, env = self.gateway_channel.recv()
        assert isinstance(env.message, p.Register), env.message
        self.gateway_channel.send(
            p.RegisterReply(True, gateway_id="bench", token_batches=True), to=peer
        )  # as a gateway
        deadline = time.monotonic() + 30
        while not link.registered and time.monotonic() < deadline:
            if link.channel.socket.poll(100):
                worker.read_socket(link.channel.socket)
        if not link.registered:
            raise RuntimeError("the worker did not take the registration reply")
        self.prefill = zmq.Context.instance().socket(zmq.DEALER)
        self.prefill.setsockopt(zmq.LINGER, 0)
        self.prefill.connect(worker.kv_address())
        self.prefill_channel = Channel(self.prefill, "bench/prefill")

    def admit(self, worker, requests: list[tuple[str, list[int], int, SamplingParams]]) -> None:
        """Send each request's KV (zeros) as its prefill worker would, and have the worker place it: every request
        decodes from the loop's first step on. requests: (request id, prompt, first token, parameters)."""
        engine = worker.engine
        layout = engine.runner.layout
        for request_id, prompt, first_token, params in requests:
            num_blocks = engine.block_manager.num_blocks_for(len(prompt))
            for lo, hi in engine.layer_groups:
                shape = [hi - lo, num_blocks, layout.block_size, 2, layout.num_kv_heads, layout.head_dim]
                kv = torch.zeros(shape, dtype=engine.dtype)  # [layers, blocks, block_size, 2, kvh, d]
                message = p.KVTransfer(
                    prefill_worker_id="bench",
                    prompt_token_ids=prompt,
                    output_token_ids=[first_token] if hi == engine.num_layers else [],
                    choices=[0],
                    sampling=params,
                    num_computed_tokens=len(prompt),
                    dtype=str(engine.dtype).removeprefix("torch."),
                    shape=shape,
                    deadline_s=time.time() + 600,
                    gateway_id="bench",
                    layer_start=lo,
                )
                self.prefill_channel.send(message, request_id, frames=[kv.numpy()])
        acks = 0
        deadline = time.monotonic() + 60
        while acks < len(requests) and time.monotonic() < deadline:
            if worker.kv_in.socket.poll(10):
                worker.read_socket(worker.kv_in.socket)
            while self.prefill.poll(0):
                _, env = self.prefill_channel.recv()
                if isinstance(env.message, p.KVAck):
                    if not env.message.accepted:
                        raise RuntimeError(f"the worker refused a transfer: {env.message.reason}")
                    acks += 1
        if acks < len(requests):
            raise RuntimeError(f"{acks} of {len(requests)} transfers placed")

    def drain(self) -> tuple[int, int]:
        """Read what the worker sent the gateway: (messages of tokens, the sequences' Tokens they carried)."""
        messages = sequences = 0
        while self.gateway.poll(0):
            received = self.gateway_channel.recv()
            message = None if received is None else received[1].message
            if isinstance(message, p.TokenBatch):
                messages, sequences = messages + 1, sequences + len(message.sequences)
            elif isinstance(message, p.Tokens):
                messages, sequences = messages + 1, sequences + 1
        return messages, sequences

    def close(self) -> None:
        for sock in (self.gateway, self.prefill):
            if sock is not None:
                sock.close()


@contextlib.contextmanager
def decode_worker(config):
    """A DecodeWorker registered with the bench's gateway; its loop may run several times (close waits for the end)."""
    from kvferry.services.decode.worker import DecodeWorker

    peers = Peers()
    worker = DecodeWorker(config, peers.address, "decode-bench", WorkerConfig(kv_bind="tcp://127.0.0.1:0"))
    close = worker.close
    worker.close = lambda: None  # serve_forever closes the worker as it ends: here, only once all runs are done
    try:
        peers.register(worker)
        yield worker, peers
    finally:
        close()
        peers.close()


def run(worker, peers: Peers, batch: int, mode: str, context: int, steps: int, rng: random.Random, profile: bool):
    """One loop run: batch sequences decoding with mode's sampling; the loop stops after WARMUP_STEPS + steps
    forward passes of the whole batch. Returns the report, and the profile's text (or "")."""
    engine = worker.engine
    max_tokens = WARMUP_STEPS + steps + 8
    run_id = uuid.uuid4().hex[:6]
    requests = [
        (
            f"loop-{run_id}-{i}",
            workload.random_prompt(rng, engine.vocab_size, context),
            rng.randrange(engine.vocab_size),
            sampling_params(mode, i, max_tokens),
        )
        for i in range(batch)
    ]
    peers.admit(worker, requests)
    profiler = cProfile.Profile() if profile else None
    full = []  # the indices of the forwards that ran the whole batch
    process_cpu = []  # the process's CPU time (all its threads) at the first measured forward and the last

    def on_forward(num_rows: int) -> None:
        if num_rows == batch:
            full.append(len(clock.starts) - 1)
        if len(full) == WARMUP_STEPS + 1 and not process_cpu:
            process_cpu.append(time.process_time())
            if profiler is not None:
                profiler.enable()
        if len(full) > WARMUP_STEPS + steps:  # this forward only closes the last measured step
            if profiler is not None:
                profiler.disable()
            process_cpu.append(time.process_time())
            worker.running = False

    clock = ForwardClock(engine.runner, on_forward)
    clock.install()
    worker.running = True
    try:
        with spans_of(worker, "step") as worker_steps, spans_of(engine, "step") as engine_steps:
            worker.serve_forever()
    finally:
        clock.uninstall()
        for request_id, *_ in requests:
            worker.forget_request(request_id, 0)
        num_tokens_messages, num_sequence_tokens = peers.drain()
    measured = full[WARMUP_STEPS:]
    if len(measured) < steps + 1 or measured != list(range(measured[0], measured[0] + len(measured))):
        raise RuntimeError(f"the batch of {batch} did not decode {steps} steps in a row")
    if not len(worker_steps) == len(engine_steps) == len(clock.starts):  # then step k ran forward k
        raise RuntimeError("a worker step ran no forward pass, or several")
    steps_at = measured[:-1]  # step i: from forward i's start to forward i + 1's

    def between(i: int, part: int) -> float:  # part 0: the wall, 1: the thread's CPU
        return clock.starts[i + 1][part] - clock.starts[i][part]

    def median_ms(values) -> float:
        return round(statistics.median(values) * 1000, 3)

    outside = [between(i, 0) - clock.forwards[i][0] for i in steps_at]
    outside_cpu = [between(i, 1) - clock.forwards[i][1] for i in steps_at]
    # The Tokens messages: the worker's step less the engine's (each output's Tokens, built and sent).
    messages = [worker_steps[i][0] - engine_steps[i][0] for i in steps_at]
    messages_cpu = [worker_steps[i][1] - engine_steps[i][1] for i in steps_at]
    process_cpu_s = (process_cpu[1] - process_cpu[0]) / steps
    report = {
        "batch": batch,
        "sampling": mode,
        "step_ms": median_ms([between(i, 0) for i in steps_at]),
        "forward_ms": median_ms([clock.forwards[i][0] for i in steps_at]),
        "outside_ms": median_ms(outside),
        "outside_cpu_ms": median_ms(outside_cpu),
        "outside_cpu_us_per_seq": round(statistics.median(outside_cpu) * 1e6 / batch, 1),
        "messages_ms": median_ms(messages),
        "messages_cpu_ms": median_ms(messages_cpu),
        "rest_cpu_ms": median_ms([o - m for o, m in zip(outside_cpu, messages_cpu)]),
        "process_cpu_ms_per_step": round(process_cpu_s * 1000, 3),  # a mean: other threads' CPU comes in lumps
        "process_cpu_us_per_token": round(process_cpu_s * 1e6 / batch, 1),
        "tokens_messages": num_tokens_messages,  # every step's, the warm-up's too: one TokenBatch a step
        "sequence_tokens": num_sequence_tokens,  # the sequences' Tokens those carried, one a sequence a step
    }
    return report, profile_text(profiler) if profiler is not None else ""


def profile_text(profiler, top: int = 25) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def measure(config, batches: list[int], modes: list[str], context: int, steps: int, profile: bool = False):
    """Every (batch, sampling) pair on one worker; returns the reports in that order."""
    unknown = [mode for mode in modes if mode not in SAMPLINGS]
    if unknown or not modes:
        raise ConfigError(f"--sampling takes {', '.join(SAMPLINGS)}, not {', '.join(unknown) or 'nothing'}")
    rng = random.Random(0)
    reports = []
    with decode_worker(config) as (worker, peers):
        for mode in modes:
            for batch in batches:
                run(worker, peers, batch, mode, context, 2, rng, False)  # the first steps at a size allocate
                report, _ = run(worker, peers, batch, mode, context, steps, rng, False)
                if profile:  # a run of its own: cProfile's overhead stays out of the reported figures
                    _, text = run(worker, peers, batch, mode, context, steps, rng, True)
                    print(
                        f"== cProfile, batch {batch}, {mode}: the loop over {steps} steps ==\n{text}", file=sys.stderr
                    )
                reports.append(report)
    return reports


def text(reports: list[dict], threads: int) -> str:
    lines = [
        f"\n== the decode worker's loop: the time between two forward passes ({threads} threads) ==",
        "wall ms (medians): the step, its forward, the rest; the loop thread's CPU ms outside the forward (medians):",
        "all of it (and per sequence), the Tokens messages' part, the rest; the process's CPU (all its threads, a",
        "mean): ms per step, us per token",
        f"{'sampling':<11} {'batch':>5} {'step':>8} {'forward':>8} {'outside':>8} | {'CPU':>7} {'us/seq':>7} "
        f"{'Tokens':>7} {'rest':>7} | {'process':>8} {'us/tok':>7}",
    ]
    for r in reports:
        lines.append(
            f"{r['sampling']:<11} {r['batch']:>5} {r['step_ms']:>8.2f} {r['forward_ms']:>8.2f} {r['outside_ms']:>8.2f} | "
            f"{r['outside_cpu_ms']:>7.2f} {r['outside_cpu_us_per_seq']:>7.1f} {r['messages_cpu_ms']:>7.2f} "
            f"{r['rest_cpu_ms']:>7.2f} | {r['process_cpu_ms_per_step']:>8.2f} {r['process_cpu_us_per_token']:>7.1f}"
        )
    return "\n".join(lines)
