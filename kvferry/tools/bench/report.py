"""What the benchmarks print: figures while they run, one line each, and the lines `bench engine` and `bench serve`
both end with."""

import sys


def say(args, title: str, figures: dict) -> None:
    if not args.json:
        print(f"{title}: " + ", ".join(f"{k}={v}" for k, v in figures.items() if k != "step_ms"), file=sys.stderr)


def against_the_floor(report: dict) -> list[str]:
    """The compute floor, the roofline and transformers' continuous batching, each against kvferry's best run."""
    k, lines = report["kvferry"], []
    if "floor" in report:
        f = report["floor"]
        lines.append(
            f"compute floor               {f['floor_output_tok_per_s']:>10}   ({f['floor_s']} s; runs {f['runs_s']} s)   "
            f"kvferry reaches {k['fraction_of_floor']:.0%} of it"
        )
    r = report.get("roofline")
    if r is not None and "total_s" not in r:
        lines.append(f"roofline                    cannot compute: {r['cannot_compute']}")
    elif r is not None:
        lines.append(
            f"roofline                    {r['output_tok_per_s']:>10}   ({r['total_s']} s, {r['limits_used']}; "
            f"`kvferry bench step --measure roofline` for its figures)   kvferry reaches "
            f"{k['fraction_of_roofline']:.0%} of it"
        )
    if "hf" in report:
        h = report["hf"]
        extra = f", {h['fraction_of_floor']:.0%} of floor" if "fraction_of_floor" in h else ""
        lines.append(
            f"transformers CB tok/s       {h['output_tok_per_s']:>10}   ({h['elapsed_s']} s{extra})   "
            f"kvferry is {h['kvferry_speedup']}x"
        )
    return lines
