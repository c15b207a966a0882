"""The GPU check's parts, in the order they run, with the time each may take on one H100.

The whole run ends within BUDGET_S of scripts/gpu_check.sh's start (STARTED_ENV), inside one device call. The
timeouts are the times measured on an H100 with a margin of a fifth or more, and add up to less than BUDGET_S, so
that a part that hangs leaves the later ones their time. A part's code is a function, "module:function", that
takes a part.Context and runs in a process of its own (run_part.py).
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
# From the script's start to the last part's end: the parts' 430 s, the script's set-up (the wheels, a first
# import of torch: up to 20 s), and a few seconds to kill the last part's processes and write the report.
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
