"""Tools pointed at a live stack unchanged: schemathesis fuzzes the OpenAPI description (no 5xx allowed), and
lm-evaluation-harness's local-completions scores a loglikelihood task exactly as the in-process engine does."""

import os
from pathlib import Path

import pytest

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.sampling import SamplingParams
from tests.e2e.stack import running_pair

pytestmark = pytest.mark.slow
TASK_DIR = Path(__file__).parent / "lm_eval"
MIN_CASES = 300


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # Tight limits keep the fuzzer's generations short on the CPU; they are in the OpenAPI description too.
    with running_pair(
        tmp_path_factory.mktemp("tools"),
        extra_env={"KVFERRY_MAX_N": "2", "KVFERRY_MAX_TOKENS_LIMIT": "2", "KVFERRY_MAX_BODY_SIZE": "4KiB"},
    ) as s:
        yield s


def test_schemathesis_finds_no_server_error(stack):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(stack.url + "/openapi.json")
    cases, server_errors, statuses = 0, [], {}
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            examples = 60 if operation.method.upper() == "POST" else 5

            @given(operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            def call(case):
                nonlocal cases
                response = case.call(base_url=stack.url, timeout=120)
                cases += 1
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code >= 500 and not (operation.path == "/health" and response.status_code == 503):
                    server_errors.append((operation.label, case.body, response.status_code, response.text[:300]))

            try:
                call()
            except Unsatisfiable:  # nothing invalid to send (a GET without parameters, in negative mode)
                pass
    print(f"schemathesis: {cases} cases, statuses {dict(sorted(statuses.items()))}")
    assert not server_errors, server_errors[:5]
    assert cases >= MIN_CASES


def test_lm_eval_local_completions_matches_the_engine(stack, tmp_path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    yaml = (TASK_DIR / "tiny_mc.yaml").read_text().replace("{data}", str(TASK_DIR / "tiny_mc.jsonl"))
    (task_dir / "tiny_mc.yaml").write_text(yaml)
    model = stack.get("/v1/models")[1]["data"][0]["id"]
    results = lm_eval.simple_evaluate(
        model="local-completions",
        tasks=["kvferry_tiny_mc"],
        task_manager=TaskManager(include_path=str(task_dir)),
        model_args={
            "base_url": stack.url + "/v1/completions",
            "model": model,
            "tokenizer_backend": "remote",
            "num_concurrent": 1,
            "max_retries": 1,
            "batch_size": 4,
        },  # 4 prompts per request
        log_samples=True,
    )
    served_acc = results["results"]["kvferry_tiny_mc"]["acc,none"]

    # The same task scored from the in-process engine's prompt logprobs, with lm-eval's context/continuation split.
    import json

    engine = LLMEngine(EngineConfig(kv_cache_memory=64 * 2**20))
    encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    correct = []
    for line in (TASK_DIR / "tiny_mc.jsonl").read_text().splitlines():
        doc = json.loads(line)
        context = f"Question: {doc['question']}\nAnswer:"
        scores = []
        for choice in doc["choices"]:
            whole, head = encode(context + " " + choice), encode(context)  # lm-eval's target delimiter: a space
            [out] = engine.generate([whole], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
            scores.append(sum(e.logprob for e in out.prompt_logprobs[len(head) :]))
        correct.append(max(range(len(scores)), key=scores.__getitem__) == doc["answer"])
    engine_acc = sum(correct) / len(correct)
    print(f"lm-eval accuracy over HTTP {served_acc}, from the in-process engine {engine_acc}")
    assert served_acc == pytest.approx(engine_acc)
    by_question = {s["doc"]["question"]: s["acc"] for s in results["samples"]["kvferry_tiny_mc"]}
    questions = [json.loads(line)["question"] for line in (TASK_DIR / "tiny_mc.jsonl").read_text().splitlines()]
    assert [by_question[q] for q in questions] == [float(c) for c in correct]  # the same docs right and wrong
