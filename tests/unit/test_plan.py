"""The planner: the cheapest shape that meets both objectives, the runners-up, the breaking load, and the binding
objective when none meets them; its --json answer."""

import json

from kvferry.common import capture
from kvferry.tools.cli import main
from kvferry.tools.sim import workload as workloads
from kvferry.tools.sim.cost_model import CostModel, StepCost, ThreadCosts
from kvferry.tools.sim.plan import Planner
from kvferry.tools.sim.slo import SLO
from kvferry.tools.sim.worker_config import Placement, WorkerConfig

# Prefill steps 10 ms; decode steps 10 ms plus 10 ms a sequence: a decode worker's ITL grows with its batch.
COSTS = CostModel({1: ThreadCosts(StepCost(0.01, 0, 0, 0), StepCost(0.01, 0, 0.01, 0))}, 0.001, 0.0, cores=16)
CONFIG = WorkerConfig(num_blocks=256, max_model_len=1024)
PLACEMENT = Placement(cores=16, prefill_threads=1, decode_threads=1)  # no contention: the shapes differ by batch


def records(num: int, every_s: float) -> list[capture.Record]:
    return [
        capture.Record(
            f"r{i}",
            "ab" * 16,
            "m",
            1000.0 + i * every_s,
            i * every_s,
            "/v1/completions",
            200,
            {"max_tokens": 20},
            prompt_token_ids=[list(range(100 + i, 116 + i))],
            output_token_ids=[list(range(500, 520))],
        )
        for i in range(num)
    ]


def planner(recs, slo: SLO, max_workers: int) -> Planner:
    return Planner(workloads.from_records(recs), COSTS, CONFIG, PLACEMENT, slo, max_workers)


def test_the_smallest_shape_that_meets_both_is_chosen_over_larger_ones_that_also_do():
    # Eight requests at once. One decode worker runs them in batches of 8 (90 ms a step): its ITL p90 misses 70 ms,
    # with one prefill worker or two. Two decode workers run 4 each (50 ms): 1P+2D meets it, and so do 1P+3D and
    # 2P+2D, which cost more; 3P+1D, decode-bound, does not.
    result = planner(records(8, 0.0), SLO(ttft_p90_s=10.0, itl_p90_s=0.07), max_workers=4).run()
    assert result.found and (result.chosen.prefill, result.chosen.decode) == (1, 2)
    assert [(r.prefill, r.decode) for r in result.runners_up] == [(1, 3), (2, 2)]
    tried = {(r.prefill, r.decode): r for r in result.tried}
    assert not tried[(1, 1)].passed and not tried[(2, 1)].passed and not tried[(3, 1)].passed
    assert "ITL p90" in tried[(1, 1)].missed[0]
    assert result.chosen.summary["itl"]["p90"] <= 0.07
    # Every request arrives at once: closer arrivals change nothing, and the search says it never broke.
    assert result.breaking_rate_scale == 64.0 and not result.breaks_below_max


def test_the_breaking_load_is_where_the_chosen_shape_stops_meeting_them():
    # A request a second, each 10 ms of prefill, 1 ms of transfer and 19 decode steps of 20 ms alone: 0.391 s. Up to
    # 1 / 0.391 = 2.56x the captured rate they never overlap and every gap is 20 ms; past it, batches of two (30 ms
    # steps) come more and more often, and the ITL p90 passes 25 ms a little beyond.
    plan = planner(records(40, 1.0), SLO(ttft_p90_s=10.0, itl_p90_s=0.025), max_workers=3)
    result = plan.run()
    assert (result.chosen.prefill, result.chosen.decode) == (1, 1)
    assert result.breaks_below_max and 2.5 <= result.breaking_rate_scale < 3.0
    assert plan.simulate(1, 1, result.breaking_rate_scale).passed
    assert not plan.simulate(1, 1, 4.0).passed
    assert result.to_json()["breaking_load"]["requests_per_s"] == result.breaking_rate_scale  # 1 request/s captured


def test_impossible_objectives_name_the_one_that_binds():
    result = planner(records(8, 0.0), SLO(ttft_p90_s=10.0, itl_p90_s=0.001), max_workers=3).run()
    assert not result.found and result.chosen is None
    assert len(result.binding) == 1 and result.binding[0].startswith("ITL: the best ITL p90 reachable is")
    assert "TTFT" not in result.binding[0] and result.best["itl"]["p90_s"] > 0.001
    assert "no shape with at most 3 workers meets" in result.text()


def test_plan_json_answers_scripts_and_exits_1_when_none_meets_them(tmp_path, capsys):
    path = tmp_path / "capture-1.jsonl"
    path.write_text("".join(r.to_line() for r in records(8, 0.0)))
    COSTS.save(tmp_path / "costs.json")
    common = [str(path), "--costs", str(tmp_path / "costs.json"), "--num-blocks", "256", "--max-model-len", "1024"]
    common += ["--cores", "16", "--prefill-threads", "1", "--decode-threads", "1", "--max-workers", "3", "--json"]
    assert main(["plan", *common, "--ttft-p90", "10", "--itl-p90", "0.07"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["found"] and answer["slo"] == {"ttft_p90_s": 10.0, "itl_p90_s": 0.07}
    chosen = answer["chosen"]
    assert (chosen["prefill"], chosen["decode"], chosen["workers"], chosen["passed"]) == (1, 2, 3, True)
    assert set(chosen["ttft"]) == set(chosen["itl"]) == {"p50", "p90", "p99", "mean"}
    assert answer["runners_up"] == [] and answer["binding"] == []  # 1P+2D is the only shape of 3 that meets them
    assert answer["breaking_load"]["rate_scale"] == 64.0 and answer["breaking_load"]["below_max"] is False
    assert [(t["prefill"], t["decode"]) for t in answer["tried"]] == [(1, 1), (1, 2), (2, 1)]
    assert main(["plan", *common, "--ttft-p90", "10", "--itl-p90", "0.001"]) == 1
    answer = json.loads(capsys.readouterr().out)
    assert not answer["found"] and answer["chosen"] is None and answer["binding"][0].startswith("ITL")
