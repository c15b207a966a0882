"""A replay's report: which deterministic outputs differ from the capture and where (first character, first token),
the latencies side by side, and the errors. Only greedy and seeded requests have one right output; sampled ones
count in the latencies alone.
"""

import os

from kvferry.common.capture import Record
from kvferry.tools.percentiles import summary
from kvferry.tools.replay.sender import Replayed

MAX_LISTED = 20  # differences and errors listed one by one in the text report


def deterministic(record: Record) -> bool:
    body = record.body or {}
    return body.get("temperature") == 0 or body.get("top_k") == 1 or body.get("seed") is not None


def differences(record: Record, answer: Replayed) -> list[dict]:
    """Each choice whose output differs from the captured one: where, in characters and in tokens."""
    out = []
    for index, captured_text in enumerate(record.output_text):
        text = answer.output_text.get(index, "")
        ids = answer.output_token_ids.get(index)
        captured_ids = record.output_token_ids[index] if index < len(record.output_token_ids) else None
        same_ids = ids is None or captured_ids is None or ids == captured_ids
        # With tool calls the stream's text is the content around them: the token ids decide, where there are any.
        same_text = text == captured_text or (answer.tool_calls and ids is not None)
        if same_ids and same_text:
            continue
        diff = {"request_id": record.request_id, "choice": index}
        if not same_text:
            at = len(os.path.commonprefix([text, captured_text]))  # any sequences, not only paths
            diff.update(char=at, captured=captured_text[at : at + 40], replayed=text[at : at + 40])
        if not same_ids:
            diff["token"] = len(os.path.commonprefix([ids, captured_ids]))
        out.append(diff)
    return out


def latencies(ttft: list, itl: list, e2e: list) -> dict:
    """p50, p90 and p99 of each, in seconds to the microsecond."""
    return {"ttft_s": summary(ttft, digits=6), "itl_s": summary(itl, digits=6), "e2e_s": summary(e2e, digits=6)}


def build_report(records: list[Record], answers: list[Replayed], elapsed_s: float, skipped: list[str]) -> dict:
    diffs, errors, compared = [], [], 0
    for record, answer in zip(records, answers):
        if answer.error or answer.status != 200:
            errors.append({"request_id": record.request_id, "status": answer.status, "error": answer.error})
            continue
        if deterministic(record) and record.status == 200:
            compared += 1
            diffs.extend(differences(record, answer))
    ok = [(r, a) for r, a in zip(records, answers) if r.status == 200 and not a.error and a.status == 200]
    captured = latencies(
        [r.ttft_s for r, _ in ok if r.ttft_s is not None],
        [gap for r, _ in ok for gaps in r.itl_s for gap in gaps],
        [r.e2e_s for r, _ in ok],
    )
    replayed = latencies(
        [a.ttft_s for _, a in ok if a.ttft_s is not None], [g for _, a in ok for g in a.itl_s], [a.e2e_s for _, a in ok]
    )
    return {
        "requests": len(records),
        "elapsed_s": round(elapsed_s, 3),
        "compared": compared,
        "identical": compared - len({d["request_id"] for d in diffs}),
        "differences": diffs,
        "errors": errors,
        "captured_errors": sum(r.status != 200 for r in records),
        "skipped_lines": skipped,
        "latency": {"captured": captured, "replayed": replayed},
    }


def format_report(report: dict) -> str:
    lines = [
        f"replayed {report['requests']} requests in {report['elapsed_s']:.1f} s; "
        f"{report['compared']} greedy or seeded compared: {report['identical']} identical, "
        f"{report['compared'] - report['identical']} differ; {len(report['errors'])} errors "
        f"({report['captured_errors']} had failed when captured)",
    ]
    if report["skipped_lines"]:
        lines.append(f"skipped {len(report['skipped_lines'])} unreadable capture lines (listed on stderr)")
    lines.append("")
    lines.append(f"{'':8}{'captured p50 / p90 / p99':>32}{'replayed p50 / p90 / p99':>32}")
    fmt = lambda p: " / ".join("-" if p[k] is None else f"{p[k] * 1000:.1f}" for k in ("p50", "p90", "p99"))
    for name in ("ttft_s", "itl_s", "e2e_s"):
        label = name[:-2].upper() + " ms"
        captured, replayed = report["latency"]["captured"][name], report["latency"]["replayed"][name]
        lines.append(f"{label:8}{fmt(captured):>32}{fmt(replayed):>32}")
    for diff in report["differences"][:MAX_LISTED]:
        where = [f"char {diff['char']}" if "char" in diff else "", f"token {diff['token']}" if "token" in diff else ""]
        text = f": captured {diff['captured']!r}, replayed {diff['replayed']!r}" if "char" in diff else ""
        lines.append(
            f"differs {diff['request_id']} choice {diff['choice']} at {', '.join(w for w in where if w)}{text}"
        )
    for error in report["errors"][:MAX_LISTED]:
        lines.append(f"error {error['request_id']}: HTTP {error['status']}: {error['error']}")
    hidden = max(0, len(report["differences"]) - MAX_LISTED) + max(0, len(report["errors"]) - MAX_LISTED)
    if hidden:
        lines.append(f"... and {hidden} more (--json lists them all)")
    return "\n".join(lines)
