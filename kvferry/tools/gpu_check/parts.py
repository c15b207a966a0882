"""The GPU check's parts, in the order they run, with the time each may take on one H100.

The whole run, the script's own set-up included, ends within BUDGET_S of the moment scripts/gpu_check.sh
started (STARTED_ENV), well inside one device call (10 minutes) and a session's 15. The timeouts are the times
measured on an H100 (2026-12-06) with a margin of a fifth or more. They add up to less than BUDGET_S, so
that a part that hangs does not take the parts after it down with it; a part also gets the time the parts
before it left unused, and every timeout is clipped to what is left. Each part's code is a function,
"module:function", that takes a part.Context; it runs in a process of its own (run_part.py).
"""

from dataclasses import dataclass

HERE = "kvferry.tools.gpu_check"


@dataclass(frozen=True)
class Part:
    name: str
    timeout_s: int
    what: str
    code: str  # "module:function"
    needs_model: bool = True  # skipped when the model part failed


PARTS = (
    Part("environment", 20, "GPU, driver and versions; the carried packages", f"{HERE}.setup_parts:environment", False),
    Part("model", 25, "SmolLM2's config and tokenizer, random weights", f"{HERE}.setup_parts:model", False),
    Part(
        "kernel_tests",
        55,
        "the kernel tests compiled, and the CUDA-only runner tests",
        f"{HERE}.bench_parts:kernel_tests",
        False,
    ),
    Part("graphs_vs_eager", 50, "greedy decode, CUDA graphs against eager", f"{HERE}.decode_parts:graphs"),
    Part("bench_step", 50, "kvferry bench step, eager against graphs", f"{HERE}.bench_parts:bench_step"),
    Part("bench_engine", 65, "kvferry bench engine std-32, eager against graphs", f"{HERE}.bench_parts:bench_engine"),
    Part("int8", 50, "the int8 kernel against its reference; bench quantization", f"{HERE}.decode_parts:int8"),
    Part("serve", 55, "a stack (gateway, prefill, decode) under bench serve std-32", f"{HERE}.bench_parts:serve"),
    Part(
        "hf_baseline",
        60,
        "transformers' continuous batching on std-32 (the baseline)",
        f"{HERE}.bench_parts:hf_baseline",
    ),
)
# From the script's start to the driver's last part's end. The parts' timeouts add up to 430 s: the script's
# set-up (the wheels, a first import of torch) may take 20 s before the driver starts without shortening
# any part, and killing the last part's processes and writing the report take a few seconds more.
BUDGET_S = 450
STARTED_ENV = "KVFERRY_GPU_CHECK_STARTED"  # when scripts/gpu_check.sh started, in seconds since the epoch
DRY_RUN_ENV = "KVFERRY_GPU_CHECK_ALLOW_CPU"  # for testing the check itself on a CPU machine: measures nothing
DRY_RUN_SLOWDOWN = 10  # on the CPU every timeout is this much longer: the kernels run under the interpreter


def by_name(names: list[str] | None) -> list[Part]:
    if not names:
        return list(PARTS)
    known = {p.name: p for p in PARTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown part(s) {', '.join(unknown)}; the parts are {', '.join(known)}")
    chosen = [p for p in PARTS if p.name in names]
    if any(p.needs_model for p in chosen):
        names = [*names, "model"]  # they run on the model it builds
    return [p for p in PARTS if p.name in names]
