"""The offline simulator: timelines worked out by hand with a fixed cost model, preemption when the decode worker's
KV fills, a property test that the real block manager is never over-committed, and unreadable capture lines."""

import collections
import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.common import capture
from kvferry.common import protocol as p
from kvferry.common.sampling import SamplingParams
from kvferry.common.sequence import Sequence
from kvferry.tools.cli import main
from kvferry.tools.sim import simulator as sim_module
from kvferry.tools.sim import workload as workloads
from kvferry.tools.sim.cost_model import CostModel, StepCost, ThreadCosts, attention_pairs
from kvferry.tools.sim.simulator import SimOptions, Simulator
from kvferry.tools.sim.worker_config import Placement, WorkerConfig
from kvferry.tools.sim.workers import SimWorker

ROUND = 1e-9  # sums of decimal step times are off by a few ulps


def record(rid: str, arrival: float, prompts: list[list[int]], outputs: list[list[int]], n: int = 1, status=200):
    return capture.Record(
        rid,
        "ab" * 16,
        "m",
        1000.0 + arrival,
        arrival,
        "/v1/completions",
        status,
        {"n": n, "max_tokens": 64},
        prompt_token_ids=prompts,
        output_token_ids=outputs,
    )


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def costs(prefill: StepCost, decode: StepCost, transfer_fixed: float, transfer_per_block: float) -> CostModel:
    return CostModel({1: ThreadCosts(prefill, decode)}, transfer_fixed, transfer_per_block, cores=4)


def simulate(records, cost_model, config, num_prefill=1, num_decode=1, **options):
    work = workloads.from_records(records)
    placement = Placement(cores=4, prefill_threads=1, decode_threads=1)
    sim = Simulator(work, cost_model, config, placement, num_prefill, num_decode, SimOptions(**options))
    return sim, sim.run()


def by_id(report) -> dict:
    return {r["id"]: r for r in report.requests}


def test_two_requests_through_one_prefill_and_one_decode_worker_follow_the_hand_worked_timeline():
    # Prefill steps cost 0.1 s + 1 ms a token; decode steps 20 ms + 10 ms a sequence; a transfer 50 ms + 10 ms a
    # block (16 tokens). No prefix caching (nothing held), four cores for two one-thread workers (no contention).
    model = costs(StepCost(0.1, 0.001, 0, 0), StepCost(0.02, 0, 0.01, 0), 0.05, 0.01)
    config = WorkerConfig(num_blocks=64, max_model_len=1024, enable_prefix_caching=False, max_num_batched_tokens=256)
    a = record("a", 0.0, [tokens(100)], [tokens(6, 500)])  # 100-token prompt (7 blocks), 6 output tokens
    b = record("b", 0.05, [tokens(40, 300)], [tokens(3, 600)])  # 40-token prompt (3 blocks), 3 output tokens
    # 0.00  a arrives; its prefill step (100 tokens: 0.2 s) runs 0.00-0.20.
    # 0.05  b arrives and queues behind it.
    # 0.20  a's first token (TTFT 0.20). Its transfer (7 blocks: 0.12 s) runs 0.20-0.32. b's prefill step
    #       (40 tokens: 0.14 s) starts: b queued 0.15 s, and runs 0.20-0.34.
    # 0.32  a is admitted; decode step (a alone: 0.03 s) 0.32-0.35.
    # 0.34  b's first token (TTFT 0.29). Its transfer (3 blocks: 0.08 s) goes on the same sender, free since
    #       0.32: 0.34-0.42.
    # 0.35, 0.38, 0.41, 0.44  a's tokens 2 to 5 (steps of a alone, 0.03 s each).
    # 0.42  b is admitted during the step that ends at 0.44, and joins the next.
    # 0.44  step of a and b (0.04 s) 0.44-0.48: a's 6th and last token (e2e 0.48), b's 2nd.
    # 0.48  step of b alone, 0.48-0.51: b's 3rd and last token (e2e 0.46).
    sim, report = simulate([a, b], model, config)
    got = by_id(report)
    assert got["a"]["ttft_s"] == pytest.approx(0.2, abs=ROUND) and got["a"]["queue_s"] == pytest.approx(0.0)
    assert got["a"]["itl_s"] == pytest.approx([0.15, 0.03, 0.03, 0.03, 0.04], abs=ROUND)
    assert got["a"]["e2e_s"] == pytest.approx(0.48, abs=ROUND)
    assert got["b"]["queue_s"] == pytest.approx(0.15, abs=ROUND) and got["b"]["ttft_s"] == pytest.approx(
        0.29, abs=ROUND
    )
    assert got["b"]["itl_s"] == pytest.approx([0.14, 0.03], abs=ROUND)
    assert got["b"]["e2e_s"] == pytest.approx(0.46, abs=ROUND)
    assert got["a"]["itl_mean_s"] == pytest.approx(0.056, abs=ROUND)
    s = report.summary
    assert (s["served"], s["refused"], s["failed"], s["preemptions"], s["output_tokens"]) == (2, 0, 0, 0, 9)
    assert s["ttft"]["p50"] == pytest.approx(0.245, abs=ROUND)  # halfway between 0.20 and 0.29
    assert s["duration_s"] == pytest.approx(0.51, abs=ROUND)
    assert report.workers["decode-0"]["steps"] == 6 and report.workers["prefill-0"]["steps"] == 2
    assert all(w.block_manager.num_free_blocks == 64 for w in sim.workers.values())  # every block back


def preemption_case(num_blocks: int):
    """One request of a 32-token prompt and n=2 choices of 40 tokens each; every prefill step (a recompute's too)
    costs 0.1 s, every decode step 10 ms, a transfer 50 ms."""
    model = costs(StepCost(0.1, 0, 0, 0), StepCost(0.01, 0, 0, 0), 0.05, 0)
    config = WorkerConfig(num_blocks=num_blocks, max_model_len=96, enable_prefix_caching=False)
    request = record("r", 0.0, [tokens(32)], [tokens(40, 500), tokens(40, 700)], n=2)
    return simulate([request], model, config)


def test_a_decode_worker_whose_kv_fills_preempts_the_newest_choice_and_recomputes_it_later():
    # Six 16-token blocks. 0.10: both first tokens; transfer 0.10-0.15. Admitted: the prompt's 2 full blocks shared,
    # a block each for the tokens that follow (4 used). Step k (k = 1, 2, ...) runs 0.15 + (k-1)/100 to
    # 0.15 + k/100 with 32 + k tokens per choice: at step 17 (49 tokens) each takes a 4th block (6 used), at step 33
    # (65 tokens) choice 0 needs a 5th and none is free: choice 1, the newest, is preempted (its own 2 blocks
    # freed, 33 tokens done) and choice 0 goes on alone: its 40th token at the end of step 39, 0.54.
    # 0.54: choice 1 is recomputed, 65 tokens in one prefill step (0.1 s, 5 blocks), which samples its 34th token
    # at 0.64 (a gap of 0.17 s since its 33rd at 0.47); six decode steps give the rest, the last at 0.70.
    sim, report = preemption_case(num_blocks=6)
    (row,) = report.requests
    assert row["preemptions"] == 1 and report.summary["preemptions"] == 1
    first, second = sim.requests[0].flights[0].choices
    assert first.finished_at == pytest.approx(0.54, abs=ROUND)
    assert second.finished_at == pytest.approx(0.70, abs=ROUND)
    assert second.gaps == pytest.approx([0.06] + [0.01] * 31 + [0.17] + [0.01] * 6, abs=ROUND)
    assert row["e2e_s"] == pytest.approx(0.70, abs=ROUND)
    assert report.workers["decode-0"]["kv_peak"] <= 1.0
    # With room for both, nothing is preempted and both end at 0.54.
    _, roomy = preemption_case(num_blocks=64)
    assert roomy.requests[0]["preemptions"] == 0 and roomy.requests[0]["e2e_s"] == pytest.approx(0.54, abs=ROUND)


def test_a_step_is_costed_by_the_cost_models_own_pairs_and_context():
    pairs_only, context_only = StepCost(0, 0, 0, 1.0), StepCost(0, 0, 0, 0, 1.0)
    config = WorkerConfig(
        num_blocks=64, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=24, long_prefill_threshold=16
    )
    for cost in (pairs_only, context_only):
        w = SimWorker("w", p.Role.PREFILL, config, 1, costs(cost, cost, 0, 0))
        w.scheduler.add(Sequence("a", tokens(20), SamplingParams(max_tokens=1)))
        w.scheduler.add(Sequence("b", tokens(5), SamplingParams(max_tokens=1)))
        first = w.scheduler.schedule()  # a's first 16 tokens, then b's 5 (the cap leaves a's last 4 for later)
        w.scheduler.update(first, [None, 7])
        plan = w.scheduler.schedule()  # a's last 4, after its 16
        assert [(c.seq.num_computed_tokens, c.num_new_tokens) for c in plan.chunks] == [(16, 4)]
        expected = attention_pairs(16, 4) if cost is pairs_only else 16 + 4
        assert w.step_seconds(plan) == expected


def test_the_simulator_uses_the_workers_own_timings_and_loads_no_torch():
    """One definition (services/worker_timings.py): the worker loop, the prefill connector and the simulator hold the
    very same objects. In a fresh interpreter, since other tests' imports would hide torch in this one's modules."""
    from kvferry.services import worker, worker_timings
    from kvferry.services.prefill import connector, shipping  # shipping: the prefill connector's sending half

    for user, name in ((shipping, "RETRY_FULL_AFTER_S"), (connector, "GIVE_UP_TRANSFER_S"), (worker, "CACHE_SYNC_S")):
        assert getattr(user, name) is getattr(worker_timings, name) is getattr(sim_module, name)
    code = "import sys, kvferry.tools.sim.cli, kvferry.tools.sim.simulator; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def check_blocks(sim, w) -> None:
    """Every block's reference count is exactly the references its holders have: running sequences, prompts a
    prefill worker keeps for their transfer, blocks a decode worker holds or fills for one; the rest are free."""
    refs = collections.Counter()
    for seq in w.scheduler.running:
        refs.update(seq.block_table)
    assert all(not seq.block_table for seq in w.scheduler.waiting)
    for request in sim.requests:
        for flight in request.flights:
            if flight.prefill is w and flight.prefill_seq.is_finished:
                refs.update(flight.prefill_seq.block_table)
            if flight.decode is w:
                refs.update(flight.held)
                refs.update(flight.blocks)
    bm = w.block_manager
    assert bm.num_used_blocks <= bm.num_blocks
    for block in range(bm.num_blocks):
        assert bm.ref_counts[block] == refs[block], (w.worker_id, block)
        assert (block in bm.free_ids) == (refs[block] == 0)


@st.composite
def small_workloads(draw):
    rng = random.Random(draw(st.integers(0, 2**32)))
    block_size = draw(st.sampled_from([4, 8, 16]))
    num_blocks = draw(st.integers(4, 24))
    max_num_seqs = draw(st.integers(1, 4))
    config = WorkerConfig(
        num_blocks=num_blocks,
        max_model_len=num_blocks * block_size,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 64)),
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=draw(st.booleans()),
        long_prefill_threshold=draw(st.sampled_from([0, 8, 32])),
    )
    prefixes = [[rng.randrange(1, 6) for _ in range(rng.randrange(0, 40))] for _ in range(3)]  # shared prefixes
    records, arrival = [], 0.0
    for i in range(draw(st.integers(1, 12))):
        arrival += rng.choice([0.0, rng.expovariate(20)])
        n = rng.randrange(1, 4)
        prompts = [
            (rng.choice(prefixes) + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 30))])[: config.max_model_len]
            for _ in range(rng.randrange(1, 3))
        ]
        outputs = [[rng.randrange(1, 9) for _ in range(rng.randrange(0, 30))] for _ in range(len(prompts) * n)]
        records.append(record(f"r{i}", arrival, prompts, outputs, n=n))
    return config, records, draw(st.integers(1, 2)), draw(st.integers(1, 2))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_workloads())
def test_the_simulated_schedulers_never_over_commit_blocks(case):
    config, records, num_prefill, num_decode = case
    model = costs(StepCost(0.01, 1e-4, 1e-3, 1e-7), StepCost(0.005, 1e-4, 1e-3, 1e-7), 0.002, 1e-4)
    sim, report = simulate(records, model, config, num_prefill, num_decode, on_step=check_blocks)
    s = report.summary
    assert s["served"] + s["refused"] + s["failed"] == s["requests"] == len(records) and s["unfinished"] == 0
    for w in sim.workers.values():
        check_blocks(sim, w)
        assert w.block_manager.num_free_blocks == w.block_manager.num_blocks  # nothing leaked
    for request in sim.requests:
        if not request.error:
            for flight in request.flights:
                room = config.max_model_len - len(flight.prompt_token_ids)  # the scheduler ends a sequence there
                assert all(len(c.gaps) == min(c.length, room) - 1 for c in flight.choices)  # every token came


def test_a_thousand_requests_are_simulated_to_the_end():
    rng = random.Random(7)
    records, arrival = [], 0.0
    for i in range(1000):
        arrival += rng.expovariate(20)
        prompt = [rng.randrange(10, 5000) for _ in range(rng.randrange(16, 300))]
        records.append(record(f"r{i}", arrival, [prompt], [tokens(rng.randrange(8, 120), 500)]))
    model = costs(StepCost(0.01, 2e-4, 5e-4, 1e-8), StepCost(0.01, 1e-4, 3e-4, 1e-8), 0.002, 1e-4)
    _, report = simulate(records, model, WorkerConfig(num_blocks=512, max_model_len=4096), 2, 2)
    assert report.summary["served"] == 1000


def test_unreadable_capture_lines_are_named_by_file_and_line_and_skipped(tmp_path, capsys):
    path = tmp_path / "capture-1.jsonl"
    good = [record(f"r{i}", i * 0.1, [tokens(20)], [tokens(5, 500)]).to_line() for i in range(3)]
    failed = record("bad-status", 0.5, [tokens(20)], [], status=500).to_line()
    path.write_text(good[0] + '{"v": 1, "request_id": "trunc\n' + good[1] + "[1, 2]\n" + failed + good[2])
    warnings = []
    work = workloads.load([path], warn=warnings.append)
    assert [r.request_id for r in work.requests] == ["r0", "r1", "r2"]
    assert (work.num_malformed, work.num_not_ok) == (2, 1)
    assert warnings[0].startswith(f"{path}:2: not JSON") and warnings[1].startswith(f"{path}:4: not a JSON object")
    model = costs(StepCost(0.01, 0, 0, 0), StepCost(0.01, 0, 0, 0), 0.0, 0.0)
    model.save(tmp_path / "costs.json")
    rc = main(
        [
            "simulate",
            str(path),
            "--costs",
            str(tmp_path / "costs.json"),
            "--num-blocks",
            "64",
            "--max-model-len",
            "1024",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0 and f"warning: {path}:2: not JSON" in err and f"{path}:4:" in err
    assert "3 replayed, 3 served" in out and "1 not ok" in out and "2 malformed lines" in out


def test_a_missing_cost_model_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "capture-1.jsonl"
    path.write_text(record("r", 0.0, [tokens(20)], [tokens(5, 500)]).to_line())
    assert main(["simulate", str(path), "--costs", str(tmp_path / "none.json"), "--num-blocks", "64"]) == 2
    assert "cannot read the cost model" in capsys.readouterr().err


def test_workers_sharing_too_few_cores_slow_each_other_by_the_fitted_contention(tmp_path):
    # Two one-token prompts on two one-thread prefill workers, each step 0.1 s alone, on one core where two busy
    # one-thread workers run 3 times slower than alone.
    # 0.00  a's step starts alone.
    # 0.05  b arrives; a has 0.05 s of work left. Both run, at a third of the pace.
    # 0.20  a's step ends (0.05 s of work at 3x); b has done 0.05 of its 0.1 s. TTFT a 0.20.
    # 0.25  b's step ends, alone again for its last 0.05 s. TTFT b 0.20.
    # With cores of their own (cores 0) neither slows the other: 0.1 s each.
    model = costs(StepCost(0.1, 0, 0, 0), StepCost(0.01, 0, 0, 0), 0.0, 0.0)
    model.contention = {"1/1": [[2.0, 3.0], [3.0, 4.0]], "1/2": [[2.0, 5.0], [3.0, 20.0]]}
    model.save(tmp_path / "costs.json")
    assert CostModel.load(tmp_path / "costs.json").contention == model.contention
    assert model.slowdown(1, 3, 2) == pytest.approx(2.0) and model.slowdown(1, 2, 2) == 1.0  # between 1 and 2
    assert model.slowdown(1, 5, 2, widest_other=2) == pytest.approx(12.5)  # a wider neighbour costs more
    assert model.slowdown(1, 8, 2) == pytest.approx(5.0)  # past the last load, its slope goes on
    assert model.slowdown(4, 9, 0) == 1.0 and CostModel(model.threads).slowdown(1, 3, 2) == 1.5  # own; fair share
    config = WorkerConfig(num_blocks=64, max_model_len=256, enable_prefix_caching=False)
    both = [record("a", 0.0, [tokens(16)], [tokens(1, 500)]), record("b", 0.05, [tokens(16, 300)], [tokens(1, 600)])]
    ttfts = {}
    for cores in (1, 0):
        work = workloads.from_records(both)
        placement = Placement(cores=cores, prefill_threads=1, decode_threads=1)
        report = Simulator(work, model, config, placement, 2, 1, SimOptions()).run()
        ttfts[cores] = sorted(r["ttft_s"] for r in report.requests)
    assert ttfts[1] == pytest.approx([0.2, 0.2], abs=ROUND)
    # One prompt alone, beside a core's worth of background work (a gateway, a load generator) on one core: 3x.
    alone = [record("a", 0.0, [tokens(16)], [tokens(1, 500)])]
    placement = Placement(cores=1, prefill_threads=1, decode_threads=1, background_threads=1.0)
    report = Simulator(workloads.from_records(alone), model, config, placement, 1, 1, SimOptions()).run()
    assert report.requests[0]["ttft_s"] == pytest.approx(0.3, abs=ROUND)
    assert ttfts[0] == pytest.approx([0.1, 0.1], abs=ROUND)


def test_a_simulated_workers_blocks_are_sized_as_the_runners(tmp_path):
    import torch
    from transformers import AutoConfig

    from kvferry.common.config import EngineConfig
    from kvferry.common.model.runner import kv_cache_layout
    from kvferry.common.model_files import read_config
    from kvferry.tools.sim.worker_config import bytes_per_block
    from tests.tiny_models import save_tiny_chat_model

    save_tiny_chat_model(tmp_path / "tiny")
    raw, hf = read_config(tmp_path / "tiny"), AutoConfig.from_pretrained(tmp_path / "tiny")
    cpu = EngineConfig(model=str(tmp_path / "tiny"), device="cpu", block_size=16)
    assert bytes_per_block(raw, 16, cpu) == kv_cache_layout(hf, 16, torch.float16).bytes_per_block  # half: auto's
    exact = EngineConfig(model=str(tmp_path / "tiny"), device="cpu", block_size=16, kv_cache_dtype="float32")
    assert bytes_per_block(raw, 16, exact) == kv_cache_layout(hf, 16, torch.float32).bytes_per_block
    gpu = EngineConfig(model=str(tmp_path / "tiny"), device="cuda", block_size=16)  # named: planned, not present
    assert bytes_per_block(raw, 16, gpu) == kv_cache_layout(hf, 16, torch.bfloat16).bytes_per_block
