import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from kvferry.tools.bench import workload
from kvferry.tools.bench.floor import GRID, floor_from_costs

REFERENCE = Path(__file__).resolve().parents[2].parent / "shared" / "bench" / "workload.py"

# The reference generator's figures (../shared/bench/workload.py, computed once from it), kept here so that a clone
# without ../shared checks them too: (name, rate, seed, vocab) -> (requests, prompt tokens, output tokens, last
# arrival_s, sha256 of the [prompt length, max_tokens] pairs, sha256 of every request in full), hashes cut to 16 hex.
EXPECTED = {
    ("std-32", 0.0, 0, 49152): (32, 3681, 3076, 0.0, "923cbb02c0920500", "45f4ea8777664b85"),
    ("std-32", 2.0, 0, 49152): (32, 4170, 3178, 14.064946, "2f6867e16c942f20", "b7a353e7ed70d126"),
    ("std-32", 0.5, 3, 32000): (32, 4669, 3387, 58.193744, "e484fe80929a4e9f", "4c7049e6c046136e"),
    ("std-128", 0.0, 0, 49152): (128, 19723, 13090, 0.0, "1f61606429722717", "5a7d05ffc3027a96"),
    ("std-128", 2.0, 0, 49152): (128, 18343, 13497, 69.683967, "35fafbbf30c75901", "1b4290e5ad649342"),
    ("std-128", 0.5, 3, 32000): (128, 18761, 12932, 261.115617, "ddfa53f27b714961", "1964a7b431c84e27"),
}


def figures(requests: list[dict]) -> tuple:
    lengths = [(len(r["prompt_token_ids"]), r["max_tokens"]) for r in requests]
    return (
        len(requests),
        sum(n for n, _ in lengths),
        sum(m for _, m in lengths),
        requests[-1]["arrival_s"],
        hashlib.sha256(json.dumps(lengths).encode()).hexdigest()[:16],
        hashlib.sha256(json.dumps(requests, sort_keys=True).encode()).hexdigest()[:16],
    )


@pytest.mark.parametrize("case", list(EXPECTED), ids=lambda c: "-".join(map(str, c)))
def test_workload_has_the_reference_figures(case):
    """Runs everywhere: the totals, the lengths and every token against the reference's recorded figures."""
    name, rate, seed, vocab = case
    assert figures(workload.generate(name, vocab, rate, seed)) == EXPECTED[case]


@pytest.mark.skipif(not REFERENCE.is_file(), reason="../shared/bench is not beside this clone")
@pytest.mark.parametrize("case", list(EXPECTED), ids=lambda c: "-".join(map(str, c)))
def test_workload_matches_the_reference_request_for_request(case):
    """Where ../shared is present: request for request the reference's output, whose figures are the ones above."""
    name, rate, seed, vocab = case
    spec = importlib.util.spec_from_file_location("reference_workload", REFERENCE)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    expected = ref.generate(name, vocab, rate, seed)
    assert workload.generate(name, vocab, rate, seed) == expected
    assert figures(expected) == EXPECTED[case]


def test_workload_shape():
    reqs = workload.generate("std-32")
    assert len(reqs) == 32 and len({r["id"] for r in reqs}) == 32
    assert all(32 <= len(r["prompt_token_ids"]) <= 384 and 32 <= r["max_tokens"] <= 256 for r in reqs)
    assert all(256 <= t < 49152 - 256 for r in reqs for t in r["prompt_token_ids"])
    assert workload.generate("std-32") == reqs  # seeded


def test_floor_arithmetic_on_known_costs():
    # Cost n/10 s for a step of n tokens (sequences): prefill in 512 chunks, decode with every unfinished request.
    costs = {n: n / 10 for n in GRID}
    reqs = [{"prompt_token_ids": [0] * 600, "max_tokens": 3}, {"prompt_token_ids": [0] * 100, "max_tokens": 2}]
    floor = floor_from_costs(costs, reqs)
    # prefill: one 512 chunk + 188 tokens; decode: step 1 has 2 unfinished (3 > 1, 2 > 1), step 2 has 1.
    assert floor["prefill_s"] == pytest.approx(70.0)
    assert floor["decode_s"] == pytest.approx(0.3)
    assert floor["floor_s"] == pytest.approx(70.3)
    assert floor["floor_output_tok_per_s"] == pytest.approx(round(5 / 70.3, 1))


def test_shared_prefix_requests_share_a_block_aligned_400_token_prompt():
    reqs = workload.generate("shared-prefix", rate=0.0)
    system = reqs[0]["prompt_token_ids"][:400]
    assert len(reqs) == 32 and all(r["prompt_token_ids"][:400] == system for r in reqs)
    assert all(50 <= len(r["prompt_token_ids"]) - 400 <= 100 and 50 <= r["max_tokens"] <= 100 for r in reqs)
    assert len({tuple(r["prompt_token_ids"][400:]) for r in reqs}) == 32  # only the system prompt is shared
    assert all(r["arrival_s"] == 0 for r in reqs)
    assert workload.generate("shared-prefix", rate=4.0)[-1]["arrival_s"] > 0


def test_head_of_line_sends_short_prompts_once_the_long_one_is_under_way():
    reqs = workload.generate("head-of-line")
    long, shorts = reqs[0], reqs[1:]
    assert long["group"] == "long" and len(long["prompt_token_ids"]) == 4000 and long["arrival_s"] == 0
    assert len(shorts) == 16 and all(r["group"] == "short" and len(r["prompt_token_ids"]) == 64 for r in shorts)
    assert all(r["arrival_s"] >= 0.3 for r in shorts)


def test_sweep_rates_parse_and_the_curve_is_drawn(tmp_path):
    import argparse

    from kvferry.tools.bench import sweep
    from kvferry.tools.bench.cli import _rates

    assert _rates("0.5,1, 4") == [0.5, 1.0, 4.0]
    for bad in ("", "1,x", "0,2", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _rates(bad)
    points = [
        {
            "rate": r,
            "output_tok_per_s": 10 * r,
            "ttft_p50_s": 0.1 * r,
            "ttft_p99_s": 0.2 * r,
            "tpot_p50_ms": 20 + r,
            "tpot_p99_ms": 30 + r,
        }
        for r in (0.5, 1, 2)
    ]
    out = tmp_path / "curve.png"
    sweep.plot(points, "std-32", str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.parametrize("name", ["std-32", "shared-prefix"])
def test_later_rounds_share_no_block_with_earlier_ones_but_keep_their_shape(name):
    from kvferry.common.block_hash import block_hashes

    base = workload.generate(name, 49152)
    assert workload.for_round(base, 0, 49152) is base
    rounds = [workload.for_round(base, i, 49152) for i in range(3)]
    seen = set()
    for requests in rounds:
        for r, b in zip(requests, base):
            assert len(r["prompt_token_ids"]) == len(b["prompt_token_ids"]) and r["max_tokens"] == b["max_tokens"]
            assert r["prompt_token_ids"][1:] == b["prompt_token_ids"][1:]
            assert 256 <= r["prompt_token_ids"][0] < 49152 - 256
        hashes = {h for r in requests for h in block_hashes(r["prompt_token_ids"], 16)}
        assert not hashes & seen
        seen |= hashes
        if name == "shared-prefix":  # still one system prompt within the round
            assert len({tuple(r["prompt_token_ids"][:400]) for r in requests}) == 1


def test_single_stream_is_one_request_of_128_prompt_tokens_and_64_outputs():
    (request,) = workload.generate("single-stream")
    assert len(request["prompt_token_ids"]) == 128 and request["max_tokens"] == 64 and request["arrival_s"] == 0
    assert request["prompt_token_ids"] == workload.generate("single-stream")[0]["prompt_token_ids"]  # seeded


def test_sampled_workloads_are_std_32_with_a_seed_per_request():
    greedy = workload.generate("std-32")
    for name, (base, sampling) in workload.SAMPLED.items():
        sampled = workload.generate(name)
        assert base == "std-32" and [{k: v for k, v in r.items() if k != "sampling"} for r in sampled] == greedy
        assert [r["sampling"] for r in sampled] == [sampling | {"seed": i} for i in range(32)]
        assert sampled[0]["sampling"]["temperature"] == 0.8
    assert workload.SAMPLED["std-32-t0.8-top-p0.95"][1]["top_p"] == 0.95
    assert workload.sampling(greedy[0]) == {"temperature": 0.0}


def test_a_sampled_request_goes_over_http_with_its_sampling():
    from kvferry.tools.bench.serve import request_body

    greedy, sampled = workload.generate("std-32")[3], workload.generate("std-32-t0.8-top-p0.95")[3]
    assert request_body("m", greedy, {})["temperature"] == 0
    body = request_body("m", sampled, {"response_format": {"type": "json_object"}})
    assert (body["temperature"], body["top_p"], body["seed"], body["ignore_eos"]) == (0.8, 0.95, 3, True)
    assert body["max_tokens"] == sampled["max_tokens"] and body["response_format"] == {"type": "json_object"}


def test_the_greedy_hf_baseline_is_refused_for_a_sampled_workload():
    import argparse

    from kvferry.common.errors import ConfigError
    from kvferry.tools.bench.hf_baseline import refuse_sampled

    refuse_sampled(argparse.Namespace(baseline="hf", workload="std-32"))
    refuse_sampled(argparse.Namespace(baseline="none", workload="std-32-t0.8"))
    with pytest.raises(ConfigError, match="decodes greedily"):
        refuse_sampled(argparse.Namespace(baseline="hf", workload="std-32-t0.8"))
