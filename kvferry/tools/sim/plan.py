"""`kvferry plan`: the cheapest pool shape (P prefill, D decode workers) whose simulation meets both latency
objectives, the runners-up, and the load at which the chosen one stops meeting them.

Shapes with P + D <= max_workers run cheapest first, each stopping as soon as a p90 certainly misses its bound.
None is pruned: on a shared machine one more prefill worker takes cores from the decode workers, so a shape that
fails proves nothing about a larger one. The breaking load is a geometric bisection of the rate scale between the
capture's own and MAX_RATE_SCALE times it. When no shape meets both, the largest shapes run to the end and the
best p90s they reach name the objective that binds.
"""

import dataclasses
from dataclasses import dataclass, field

from kvferry.tools.sim.cost_model import CostModel
from kvferry.tools.sim.report import Report
from kvferry.tools.sim.simulator import SimOptions, Simulator
from kvferry.tools.sim.slo import SLO
from kvferry.tools.sim.worker_config import Placement, WorkerConfig
from kvferry.tools.sim.workload import Workload

RUNNERS_UP = 3
MAX_RATE_SCALE = 64.0
RATE_PRECISION = 1.05  # the breaking load's bounds end this close (their ratio)
SHAPE_FIGURES = ("ttft", "itl", "e2e", "output_tokens_per_s", "stopped_early")  # of its summary, in its JSON


@dataclass
class ShapeResult:
    prefill: int
    decode: int
    threads: int
    missed: list[str]  # empty: it meets both objectives
    summary: dict

    @property
    def passed(self) -> bool:
        return not self.missed

    def to_json(self) -> dict:
        shape = {"prefill": self.prefill, "decode": self.decode, "workers": self.prefill + self.decode}
        verdict = {"threads": self.threads, "passed": self.passed, "missed": self.missed}
        return shape | verdict | {key: self.summary[key] for key in SHAPE_FIGURES}

    def label(self) -> str:
        return f"{self.prefill}P+{self.decode}D"


@dataclass
class PlanResult:
    slo: SLO
    max_workers: int
    capture_requests_per_s: float
    chosen: ShapeResult | None = None
    runners_up: list[ShapeResult] = field(default_factory=list)
    tried: list[ShapeResult] = field(default_factory=list)
    # The largest rate scale (against the capture's own rate) found to meet them; None: not searched.
    breaking_rate_scale: float | None = None
    max_rate_scale: float = MAX_RATE_SCALE  # how far it searched
    breaks_below_max: bool = True  # False: it still meets them at max_rate_scale
    binding: list[str] = field(default_factory=list)  # why none meets them
    best: dict = field(default_factory=dict)  # the best p90s the largest shapes reach

    @property
    def found(self) -> bool:
        return self.chosen is not None

    def to_json(self) -> dict:
        out = {
            "found": self.found,
            "slo": {"ttft_p90_s": self.slo.ttft_p90_s, "itl_p90_s": self.slo.itl_p90_s},
            "max_workers": self.max_workers,
            "chosen": self.chosen.to_json() if self.chosen else None,
            "runners_up": [r.to_json() for r in self.runners_up],
            "breaking_load": None,
            "binding": self.binding,
            "best": self.best,
            "tried": [r.to_json() for r in self.tried],
        }
        if self.chosen and self.breaking_rate_scale is not None:
            out["breaking_load"] = {
                "rate_scale": self.breaking_rate_scale,
                "requests_per_s": self.breaking_rate_scale * self.capture_requests_per_s,
                "below_max": self.breaks_below_max,
                "max_rate_scale": self.max_rate_scale,
            }
        return out

    def text(self) -> str:
        slo = self.slo
        want = f"TTFT p90 <= {slo.ttft_p90_s:g} s and ITL p90 <= {slo.itl_p90_s:g} s"
        if not self.found:
            lines = [f"no shape with at most {self.max_workers} workers meets {want}"]
            lines += [f"  binding: {b}" for b in self.binding]
            return "\n".join(lines)
        c = self.chosen
        lines = [f"cheapest shape meeting {want}: {c.label()} ({c.threads} threads)", _figures(c)]
        if self.breaking_rate_scale is not None:
            load = f"x the captured load ({self.breaking_rate_scale * self.capture_requests_per_s:.2f} requests/s)"
            if self.breaks_below_max:
                lines.append(f"  it meets them up to about {self.breaking_rate_scale:.2f}{load}, not beyond")
            else:
                lines.append(f"  it still meets them at {self.max_rate_scale:g}{load}")
        for r in self.runners_up:
            lines += [f"runner-up: {r.label()} ({r.threads} threads)", _figures(r)]
        return "\n".join(lines)


def _figures(r: ShapeResult) -> str:
    s = r.summary
    return (
        f"  TTFT p50/p90/p99 {_ms(s['ttft'])}; ITL {_ms(s['itl'])}; e2e p90 {_s(s['e2e']['p90'])}; "
        f"{s['output_tokens_per_s']:.1f} output tokens/s"
    )


def _ms(d: dict) -> str:
    return "/".join("-" if d[k] is None else f"{d[k] * 1000:.1f}" for k in ("p50", "p90", "p99")) + " ms"


def _s(value) -> str:
    return "-" if value is None else f"{value:.2f} s"


class Planner:
    def __init__(
        self,
        workload: Workload,
        costs: CostModel,
        config: WorkerConfig,
        placement: Placement,
        slo: SLO,
        max_workers: int = 8,
        options: SimOptions | None = None,
    ):
        self.workload, self.costs, self.config, self.placement, self.slo = workload, costs, config, placement, slo
        self.max_workers = max_workers
        self.options = options or SimOptions()

    def shapes(self) -> list[tuple[int, int]]:
        """Every (P, D) with P + D <= max_workers, cheapest first."""
        pt, dt = self.placement.prefill_threads, self.placement.decode_threads
        shapes = [(p, d) for p in range(1, self.max_workers) for d in range(1, self.max_workers - p + 1)]
        return sorted(shapes, key=lambda s: (s[0] + s[1], s[0] * pt + s[1] * dt, s[0]))

    def simulate(self, prefill: int, decode: int, rate_scale: float | None = None, stop: bool = True) -> ShapeResult:
        options = dataclasses.replace(
            self.options,
            rate_scale=rate_scale or self.options.rate_scale,
            stop_on=self.slo if stop else None,
        )
        report: Report = Simulator(
            self.workload, self.costs, self.config, self.placement, prefill, decode, options
        ).run()
        threads = prefill * self.placement.prefill_threads + decode * self.placement.decode_threads
        missed = self.slo.missed(report.summary)
        if report.summary["stopped_early"] and not missed:
            missed = [report.summary["stopped_early"]]
        return ShapeResult(prefill, decode, threads, missed, report.summary)

    def run(self) -> PlanResult:
        requests = self.workload.requests  # their mean arrival rate: 0 when all arrived at once
        span = requests[-1].arrival_s - requests[0].arrival_s if len(requests) > 1 else 0.0
        result = PlanResult(self.slo, self.max_workers, (len(requests) - 1) / span if span > 0 else 0.0)
        for prefill, decode in self.shapes():
            shape = self.simulate(prefill, decode)
            result.tried.append(shape)
            if not shape.passed:
                continue
            if result.chosen is None:
                result.chosen = shape
            else:
                result.runners_up.append(shape)
                if len(result.runners_up) == RUNNERS_UP:
                    break
        if result.chosen is not None:
            self._breaking_load(result)
        else:
            self._binding(result)
        return result

    def _breaking_load(self, result: PlanResult) -> None:
        c, base = result.chosen, self.options.rate_scale
        result.max_rate_scale = base * MAX_RATE_SCALE
        if self.simulate(c.prefill, c.decode, base * MAX_RATE_SCALE).passed:
            result.breaking_rate_scale, result.breaks_below_max = base * MAX_RATE_SCALE, False
            return
        good, bad = base, base * MAX_RATE_SCALE
        while bad / good > RATE_PRECISION:
            mid = (good * bad) ** 0.5
            if self.simulate(c.prefill, c.decode, mid).passed:
                good = mid
            else:
                bad = mid
        result.breaking_rate_scale = good

    def _binding(self, result: PlanResult) -> None:
        """Why no shape meets them: the best p90s reached by the largest shapes, run to the end, and by the others
        whose runs went to the end anyway."""
        largest = [self.simulate(p, self.max_workers - p, stop=False) for p in range(1, self.max_workers)]
        if not largest:
            result.binding.append(f"--max-workers {self.max_workers} leaves no room for one prefill and one decode")
            return
        runs = largest + [r for r in result.tried if not r.summary["stopped_early"]]
        best = {}
        for key, name, bound in (("ttft", "TTFT", self.slo.ttft_p90_s), ("itl", "ITL", self.slo.itl_p90_s)):
            reached = [r for r in runs if r.summary[key]["p90"] is not None]
            if not reached:
                result.binding.append(f"no request was served on shapes of {self.max_workers} workers")
                continue
            top = min(reached, key=lambda r: r.summary[key]["p90"])
            value = top.summary[key]["p90"]
            best[key] = {"p90_s": value, "shape": top.label()}
            if value > bound:
                result.binding.append(
                    f"{name}: the best {name} p90 reachable is {value:.3f} s ({top.label()}) > {bound:g} s"
                )
        if all(r.summary["refused"] or r.summary["failed"] for r in largest):
            result.binding.append(
                "every shape of the most workers refuses or fails requests (the gateway's --max-waiting, or a "
                "transfer no decode worker takes)"
            )
        if not result.binding:
            result.binding.append(
                f"each objective is met by some shape of {self.max_workers} workers, but no shape meets both"
            )
        result.best = best
