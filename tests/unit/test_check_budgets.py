"""The gateway's checks of a request's content are bounded by its size: each counts its steps against a budget in
proportion to its input, stops when the request is no longer wanted, and refuses (400, naming the field) what would
cost more, or crash the check, instead of answering with a 500 or holding a text thread for hours."""

import json
import threading

import pytest

from kvferry.common.json_schema_support import (
    MAX_PATTERN_DEPTH,
    MAX_REF_DEPTH,
    MAX_VALUE_CHARS,
    UnsupportedSchema,
    check_supported,
)
from kvferry.common.work_budget import CHECK_EVERY, RequestWork, WorkBudget, WorkCancelled, current_request
from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.constraints import structured
from kvferry.services.gateway.schema_checks import checked_schema

GUARD_S = 60  # only a guard against a hang: what is asserted are counts and outcomes


def shared_properties(num_properties: int) -> dict:
    """A oneOf whose two branches are one object of num_properties required properties, each that object again: the
    overlap check compared them pairwise, recursing into each shared property (num_properties ** 3 comparisons)."""
    props = {f"p{i}": {"$ref": "#/$defs/o"} for i in range(num_properties)}
    return {
        "$defs": {"o": {"type": "object", "properties": props, "required": list(props)}},
        "oneOf": [{"$ref": "#/$defs/o"}, {"$ref": "#/$defs/o"}],
    }


def compact_size(schema) -> int:
    return len(json.dumps(schema, separators=(",", ":")))


def in_thread(fn, *args):
    """fn(*args) on a thread, joined within GUARD_S: (result, exception)."""
    outcome = {}

    def run():
        try:
            outcome["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GUARD_S)
    assert not thread.is_alive(), f"the check ran past the {GUARD_S} s guard"
    return outcome.get("result"), outcome.get("error")


def test_a_schema_whose_check_grows_faster_than_its_size_is_refused_within_its_budget():
    schema = shared_properties(300)  # 10 KB: 27 million comparisons before the budget
    budget = WorkBudget(compact_size(schema))
    _, error = in_thread(check_supported, schema, "response_format.json_schema.schema", budget)
    assert isinstance(error, UnsupportedSchema)
    assert error.path == "response_format.json_schema.schema" and "steps its size allows" in error.why
    assert budget.num_spent <= budget.num_steps + compact_size(schema)  # one spend may pass the end by its own size


def test_the_same_schema_through_the_gateways_check_is_a_400_naming_the_field():
    _, error = in_thread(checked_schema, shared_properties(2000), "response_format.json_schema.schema")
    assert isinstance(error, ApiError) and error.status == 400
    assert error.param == "response_format.json_schema.schema"


def test_a_budget_grows_with_its_input_and_ordinary_schemas_stay_far_inside():
    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name"],
    }
    union = {"oneOf": [{"const": f"label-{i}"} for i in range(256)]}  # every pair compared: 32,640 pairs
    for schema in (person, union):
        budget = WorkBudget(compact_size(schema))
        check_supported(schema, "s", budget)
        assert budget.num_spent < budget.num_steps / 2
    assert WorkBudget(100_000).num_steps > WorkBudget(1_000).num_steps


@pytest.mark.parametrize("why", ["cancelled", "deadline"])
def test_a_check_nobody_waits_for_stops_at_its_next_look(why):
    """A client that left (its request's work cancelled) or a request past its deadline: the check ends within
    CHECK_EVERY steps of it, however much budget is left."""
    work = RequestWork(deadline=None if why == "cancelled" else 0.0)
    if why == "cancelled":
        work.cancel()
    token = current_request.set(work)
    try:
        budget = WorkBudget(0, base_steps=10**12)  # a budget that would never run out
    finally:
        current_request.reset(token)
    _, error = in_thread(check_supported, shared_properties(300), "s", budget)
    assert isinstance(error, WorkCancelled)
    assert budget.num_spent <= CHECK_EVERY + compact_size(shared_properties(300))


def test_a_check_stops_when_its_request_is_cancelled_while_it_runs():
    work = RequestWork()
    token = current_request.set(work)
    try:
        budget = WorkBudget(0, base_steps=10**12)
    finally:
        current_request.reset(token)
    started = threading.Event()
    spend = budget.spend

    def counting(num_steps=1):
        started.set()
        spend(num_steps)

    budget.spend = counting
    threading.Thread(target=lambda: (started.wait(GUARD_S), work.cancel()), daemon=True).start()
    _, error = in_thread(check_supported, shared_properties(2000), "s", budget)
    assert isinstance(error, WorkCancelled)
    assert budget.num_spent < 10**9


def test_a_long_type_list_is_refused_before_the_metaschema_compares_its_items_pairwise():
    # jsonschema holds a type list unique by comparing unsortable items pairwise: 11,000 took 130 s
    _, error = in_thread(checked_schema, {"type": [{"a": i} for i in range(11_000)]}, "f")
    assert isinstance(error, ApiError) and error.status == 400 and error.param == "f"
    assert error.message.startswith("f.type: a list of at most 7")


def test_required_names_that_are_not_strings_are_refused_before_the_metaschema():
    _, error = in_thread(checked_schema, {"type": "object", "required": [{"a": i} for i in range(5000)]}, "f")
    assert isinstance(error, ApiError) and error.status == 400 and "f.required" in error.message


@pytest.mark.parametrize(
    "where",
    [
        {"type": "string", "pattern": "(" * 900 + "a" + ")" * 900},
        {"type": "object", "patternProperties": {"(" * 900 + "a" + ")" * 900: {"type": "string"}}},
    ],
)
def test_a_deeply_nested_pattern_is_a_400_not_a_recursion_error(where):
    _, error = in_thread(checked_schema, where, "f")
    assert isinstance(error, ApiError) and error.status == 400 and error.param == "f"
    assert f"nested more than {MAX_PATTERN_DEPTH}" in error.message


def test_a_pattern_nested_within_the_bound_is_accepted():
    depth = MAX_PATTERN_DEPTH
    checked_schema({"type": "string", "pattern": "(" * depth + "[(]a\\(" + ")" * depth}, "f")


@pytest.mark.parametrize("index", ["²", "1" * 5000, "-1", "01x"])
def test_a_ref_index_that_is_not_a_plain_number_points_at_nothing(index):
    schema = {"type": "array", "prefixItems": [{"type": "string"}], "items": {"$ref": f"#/prefixItems/{index}"}}
    _, error = in_thread(checked_schema, schema, "f")
    assert isinstance(error, ApiError) and error.status == 400 and "points at nothing" in error.message


def test_a_ref_index_in_range_still_resolves():
    schema = {"type": "array", "prefixItems": [{"type": "string"}], "items": {"$ref": "#/prefixItems/0"}}
    checked_schema(schema, "f")


def ref_chain(num_links: int) -> dict:
    defs = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"type": "null"}]} for i in range(num_links)}
    defs[f"a{num_links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def test_a_chain_of_refs_past_the_bound_is_refused_and_one_within_it_accepted():
    with pytest.raises(ApiError, match=f"more than {MAX_REF_DEPTH} \\$refs") as refused:
        checked_schema(ref_chain(1500), "f")  # 98 KB, and 3.8 s of compile
    assert refused.value.param == "f"
    checked_schema(ref_chain(MAX_REF_DEPTH - 1), "f")


def test_a_recursive_schema_is_not_a_chain_past_the_bound():
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#"}}},
                "required": ["value"],
            }
        },
        "$ref": "#/$defs/node",
    }
    checked_schema(tree, "f")


def test_enum_and_const_values_together_are_bounded_in_characters():
    values = [f"{i:04d}-" + "x" * 95 for i in range(1024)]  # 1,024 hundred-character values: ~25 MiB compiled
    with pytest.raises(ApiError, match=f"more than {MAX_VALUE_CHARS} characters") as refused:
        checked_schema({"type": "object", "properties": {"a": {"enum": values}}}, "response_format.json_schema.schema")
    assert refused.value.param == "response_format.json_schema.schema"
    checked_schema({"enum": values[: MAX_VALUE_CHARS // 110]}, "f")  # within the bound


def test_choices_are_bounded_in_count_and_characters():
    with pytest.raises(ApiError, match="choices; at most") as many:
        structured("choice", [f"c{i}" for i in range(10_000)], "structured_outputs.choice")
    assert many.value.param == "structured_outputs.choice"
    with pytest.raises(ApiError, match="characters in all") as long:
        structured("choice", ["y" * 1000] * 40, "structured_outputs.choice")
    assert long.value.param == "structured_outputs.choice"
    structured("choice", ["yes", "no"], "structured_outputs.choice")


def test_chains_that_join_are_one_chain_whichever_order_they_are_walked_in():
    """Five chains of 60 links, each ending at the head of the one before: one chain of 300, refused in any order
    (the depth remembered for a $ref counts with the chain that reaches it again)."""
    defs = {}
    for chain in range(5):
        for i in range(60):
            nxt = f"c{chain}_{i + 1}" if i < 59 else (f"c{chain - 1}_0" if chain else None)
            defs[f"c{chain}_{i}"] = {"anyOf": [{"$ref": f"#/$defs/{nxt}"}, {"type": "null"}]} if nxt else {}
    for order in (range(5), range(4, -1, -1)):
        schema = {"$defs": defs, "anyOf": [{"$ref": f"#/$defs/c{chain}_0"} for chain in order]}
        with pytest.raises(UnsupportedSchema, match=f"more than {MAX_REF_DEPTH}"):
            check_supported(schema, "s")


def test_the_first_pass_looks_at_schemas_only_not_at_values_or_property_names():
    """A property named like a keyword, and values that look like schemas (enum, const, default, examples), are the
    user's: the bounds on `type` lists and `required` names are not theirs to meet."""
    keyword_names = {
        "dependencies": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "required": {"enum": [1, 2, 3]},
        "type": {"const": "x"},
    }
    checked_schema({"type": "object", "properties": keyword_names}, "f")
    looks_like_a_schema = {"type": ["a", "b", "c", "d", "e", "f", "g", "h"], "required": [1, 2]}
    checked_schema({"type": "object", "default": looks_like_a_schema, "examples": [looks_like_a_schema]}, "f")
    checked_schema({"enum": [looks_like_a_schema]}, "f")


def costly_but_sound(num_properties: int, tags=("a", "b")) -> dict:
    """Parameters whose oneOf is told apart only by its last required property: every shared one before it is
    compared in depth first (about 160,000 steps at 28), well within this schema's own budget."""
    shared = {f"p{i}": {"$ref": "#/$defs/o"} for i in range(num_properties)}

    def branch(tag):
        return {"type": "object", "properties": {**shared, "tag": {"const": tag}}, "required": [*shared, "tag"]}

    o = {"type": "object", "properties": shared, "required": list(shared)}
    return {"type": "object", "$defs": {"o": o}, "properties": {"x": {"oneOf": [branch(tag) for tag in tags]}}}


def test_a_requests_checks_together_are_bounded_not_only_each_one():
    """40 tools, each costing most of its own budget: before, 40 base allowances (6 million steps); now the request's
    checks share one bound, and the tool that passes it is refused by name."""
    from kvferry.services.gateway.api import REQUEST_CHECK_STEPS
    from kvferry.services.gateway.tools import parse_tools

    one = costly_but_sound(28)
    budget = WorkBudget(compact_size(one))
    check_supported(one, "s", budget)  # alone, it passes within its own budget
    assert budget.num_spent > REQUEST_CHECK_STEPS / 40
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": one}} for i in range(40)]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    work = RequestWork(num_steps=REQUEST_CHECK_STEPS)
    token = current_request.set(work)
    try:
        with pytest.raises(ApiError) as refused:  # here: a thread of its own would not carry the request's context
            parse_tools(body)
    finally:
        current_request.reset(token)
    error = refused.value
    assert error.status == 400 and error.param.startswith("tools[")
    assert "a request's checks may take together" in error.message
    assert -compact_size(one) <= work.num_steps_left < 0  # stopped at the bound, not after every tool
