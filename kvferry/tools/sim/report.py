"""What a simulation found, as text and as JSON: per request, the distributions, KV usage over time, throughput.

ITL percentiles pool every gap between two tokens of a choice, of all requests, as the gateway's histogram does;
the first gap includes the KV transfer. Refused and failed requests have no latency: they are counted apart.
"""

import dataclasses
from dataclasses import dataclass, field

from kvferry.tools.sim.slo import distribution


@dataclass
class Report:
    shape: dict  # the stack simulated: workers, threads, cores, rate scale, the workers' settings
    summary: dict
    requests: list[dict] = field(default_factory=list)
    kv_usage: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # decode worker -> (s, used share)
    workers: dict[str, dict] = field(default_factory=dict)  # steps and busy share of each
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        out = {"shape": self.shape, "summary": self.summary, "workers": self.workers, "notes": self.notes}
        out["kv_usage"] = {w: [[round(t, 4), round(u, 4)] for t, u in samples] for w, samples in self.kv_usage.items()}
        out["requests"] = [{**r, "itl_s": [round(g, 6) for g in r["itl_s"]]} for r in self.requests]
        return out

    def text(self, per_request: bool = False) -> str:
        s, shape = self.summary, self.shape
        lines = [
            f"simulated {shape['prefill']}P+{shape['decode']}D ({shape['prefill_threads']} and "
            f"{shape['decode_threads']} threads a worker, "
            f"{shape['cores'] or 'own'} cores), arrivals x{shape['rate_scale']:g}",
            f"requests: {s['requests']} replayed, {s['served']} served, {s['refused']} refused, {s['failed']} failed; "
            f"skipped from the capture: {s['skipped_not_ok']} not ok, {s['skipped_without_prompt']} without prompt "
            f"ids, {s['malformed_lines']} malformed lines",
            f"{'':<10}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}",
        ]
        for name, key in (("TTFT", "ttft"), ("ITL", "itl"), ("e2e", "e2e"), ("queue", "queue")):
            d = s[key]
            lines.append(f"{name + ' s':<10}" + "".join(_cell(d[k]) for k in ("p50", "p90", "p99", "mean")))
        lines.append(
            f"throughput: {s['output_tokens_per_s']:.1f} output tokens/s, {s['requests_per_s']:.2f} requests/s over "
            f"{s['duration_s']:.1f} s (virtual); {s['preemptions']} preemptions"
        )
        for worker, w in self.workers.items():
            kv = f", KV peak {w['kv_peak']:.0%} mean {w['kv_mean']:.0%}" if "kv_peak" in w else ""
            lines.append(f"  {worker}: {w['steps']} steps, busy {w['busy_share']:.0%}{kv}")
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"simulated in {s['wall_s']:.2f} s")
        if per_request:
            lines.append(
                f"{'request':<40}{'arrival':>9}{'queue':>9}{'TTFT':>9}{'ITL mean':>10}{'e2e':>9}{'preempt':>8}"
            )
            for r in self.requests:
                lines.append(
                    f"{r['id']:<40}{r['arrival_s']:>9.3f}"
                    + "".join(_cell(r[k], 9) for k in ("queue_s", "ttft_s"))
                    + _cell(r["itl_mean_s"], 10)
                    + _cell(r["e2e_s"], 9)
                    + f"{r['preemptions']:>8}"
                    + (f"  {r['error']}" if r["error"] else "")
                )
        return "\n".join(lines)


def _cell(value, width: int = 10) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.4f}"


def build_report(sim) -> Report:
    """The report of a finished (or early stopped) Simulator."""
    rows, ttft, itl, e2e, queue, ends = [], [], [], [], [], []
    num_tokens = 0
    for r in sim.requests:
        gaps = r.gaps
        row = {
            "id": r.spec.request_id,
            "arrival_s": round(r.arrival, 6),
            "queue_s": r.queue,
            "ttft_s": r.ttft,
            "itl_mean_s": sum(gaps) / len(gaps) if gaps else None,
            "itl_s": gaps,
            "e2e_s": r.e2e,
            "preemptions": r.num_preemptions,
            "prompt_tokens": sum(len(ids) for ids in r.spec.prompts),
            "output_tokens": r.num_output_tokens,
            "workers": [[f.prefill.worker_id, f.decode.worker_id] for f in r.flights],
            "error": r.error,
        }
        rows.append(row)
        if r.error:
            continue
        if r.ttft is not None:
            ttft.append(r.ttft)
            queue.append(r.queue)
        itl.extend(gaps)
        if r.e2e is not None:
            num_tokens += r.num_output_tokens
            e2e.append(r.e2e)
            ends.append(r.finished_at)
    duration = max(ends) - sim.requests[0].arrival if ends else 0.0  # requests are in arrival order
    num_served = len(e2e)
    w = sim.workload
    summary = {
        "requests": len(w.requests),
        "served": num_served,
        "refused": sim.num_refused,
        "failed": sim.num_failed,
        "unfinished": len(w.requests) - num_served - sim.num_refused - sim.num_failed,
        "skipped_not_ok": w.num_not_ok,
        "skipped_without_prompt": w.num_without_prompt,
        "malformed_lines": w.num_malformed,
        "ttft": distribution(ttft),
        "itl": distribution(itl),
        "e2e": distribution(e2e),
        "queue": distribution(queue),
        "preemptions": sum(row["preemptions"] for row in rows),
        "output_tokens": num_tokens,
        "duration_s": duration,
        "output_tokens_per_s": num_tokens / duration if duration > 0 else 0.0,
        "requests_per_s": num_served / duration if duration > 0 else 0.0,
        "stopped_early": sim.stopped,
        "wall_s": sim.wall_s,
    }
    workers, kv_usage, end = {}, {}, max(sim.now, 1e-9)
    for worker in sim.workers.values():
        workers[worker.worker_id] = {"steps": worker.num_steps, "busy_share": min(1.0, worker.busy_s / end)}
        if worker.worker_id in sim.kv_usage:
            total = worker.block_manager.num_blocks
            samples = [(t, used / total) for t, used in sim.kv_usage[worker.worker_id]]
            kv_usage[worker.worker_id] = samples
            shares = [u for _, u in samples] or [0.0]
            workers[worker.worker_id].update(kv_peak=max(shares), kv_mean=sum(shares) / len(shares))
    placement, config = sim.placement, sim.config
    shape = {"prefill": len(sim.prefill_workers), "decode": len(sim.decode_workers), **dataclasses.asdict(placement)}
    shape.update(rate_scale=sim.options.rate_scale, worker=dataclasses.asdict(config))
    notes = []
    for role, threads in (("prefill", placement.prefill_threads), ("decode", placement.decode_threads)):
        if threads not in sim.costs.threads:
            used = sim.costs.nearest_threads(threads)
            notes.append(f"the cost model has no figures for {threads} threads: the {role} workers use {used}'s")
    if sim.stopped:
        notes.append(f"stopped early: {sim.stopped}")
    return Report(shape, summary, rows, kv_usage, workers, notes)
