"""`kvferry bench costs --quick` on a tiny model: the cost model it writes loads, has no negative coefficient, and
predicts what it measured; and the fit itself recovers known costs."""

import json

import numpy as np
import pytest

from kvferry.tools.bench.costs import Point, fit_relative, fit_step_cost, nnls
from kvferry.tools.cli import main
from kvferry.tools.sim.cost_model import CostModel, attention_pairs
from tests.tiny_models import save_tiny_model


def test_quick_fit_writes_a_cost_model_that_predicts_its_own_points(tmp_path, capsys):
    save_tiny_model("llama", tmp_path / "model")
    out = tmp_path / "costs.json"
    argv = ["bench", "costs", "--quick", "--model", str(tmp_path / "model"), "--out", str(out), "--threads", "1"]
    assert main([*argv, "--block-size", "8", "--kv-cache-memory", "1MiB", "--no-transfer", "--no-contention"]) == 0
    model = CostModel.load(out)
    assert set(model.threads) == {1} and model.block_size == 8 and model.model == "model"
    assert model.machine and model.measured_at and model.cores >= 1
    costs = model.costs(1)
    for step in (costs.prefill, costs.decode):
        assert min(step.fixed_s, step.per_token_s, step.per_seq_s, step.per_pair_s, step.per_context_s) >= 0
        assert step.fixed_s > 0  # a step of nothing still costs its dispatch
    assert costs.decode.per_token_s == 0  # decode: tokens == seqs, the per-sequence cost carries both
    notes = model.notes
    for kind in ("prefill", "decode"):
        assert notes["residuals"]["1"][kind]["median_rel_err"] < 0.5
    points = notes["points"]
    assert {p[0] for p in points} == {"prefill", "decode"} and len(points) == 12 + 6
    for kind, _, context, tokens, seqs, pairs, gathered, seconds in points:
        assert seconds > 0
        if kind == "prefill":  # chunks at the offset, tokens // seqs each: computed as the plan ran them
            assert pairs == seqs * attention_pairs(context, tokens // seqs) and gathered == seqs * context + tokens
        else:  # one new token per sequence, attending to its whole context
            assert tokens == seqs and pairs == gathered >= seqs * context
    # The bigger the step, the slower it is predicted: the largest prefill well above the smallest (a fit of the
    # fixed cost alone, or with a term's sign wrong, fails), and no decode step below a smaller one.
    for prefill in (True, False):
        mine = sorted((p for p in points if (p[0] == "prefill") == prefill), key=lambda p: (p[3], p[5]))
        predicted = [model.step_seconds(prefill, 1, *p[3:7]) for p in mine]  # tokens, seqs, pairs, gathered
        assert predicted[-1] >= predicted[0] * (1.05 if prefill else 1)
    assert json.loads(out.read_text())["version"] == 1
    table = capsys.readouterr().out
    assert "prefill, 1 thread(s)" in table and "decode, 1 thread(s)" in table and "measured" in table


def test_nnls_is_exact_and_never_negative():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (30, 4))
    x = np.array([0.5, 0.0, 2.0, 1.0])
    assert np.allclose(nnls(a, a @ x), x, atol=1e-9)
    b = a @ np.array([1.0, -3.0, 1.0, 0.0])  # the unconstrained answer has a negative coefficient
    found = nnls(a, b)
    assert (found >= 0).all()
    # Optimal under x >= 0 (KKT): no gradient along a positive coefficient, none pointing below zero at a zero one.
    gradient = a.T @ (a @ found - b)
    assert np.allclose(gradient[found > 0], 0, atol=1e-9) and (gradient[found == 0] >= -1e-9).all()
    assert (found == 0).any()


def test_the_fit_recovers_known_step_costs_on_relative_error():
    true = dict(fixed=2e-3, token=1e-4, seq=5e-4, pair=2e-8, context=1e-5)
    points = []
    for offset in (0, 256, 1024):
        for seqs in (1, 2, 4):
            for tokens in (16, 64, 256, 512):
                pairs, context = seqs * attention_pairs(offset, tokens // seqs), seqs * offset + tokens
                t = true["fixed"] + true["token"] * tokens + true["seq"] * seqs + true["pair"] * pairs
                t += true["context"] * context
                t *= 1.02 if tokens == 64 else 1
                points.append(Point("prefill", 1, offset, tokens, seqs, pairs, t, 3, gathered=context))
    cost = fit_step_cost(points)
    assert cost.fixed_s == pytest.approx(true["fixed"], rel=0.1)
    assert cost.per_token_s == pytest.approx(true["token"], rel=0.1)
    assert cost.per_pair_s == pytest.approx(true["pair"], rel=0.1)
    assert cost.per_context_s == pytest.approx(true["context"], rel=0.1)
    assert max(abs(p.rel_err) for p in points) < 0.03
    fixed, per_block = fit_relative([[1, 8], [1, 32], [1, 128]], [0.004 + 8e-4 * b for b in (8, 32, 128)])
    assert fixed == pytest.approx(0.004) and per_block == pytest.approx(8e-4)
