"""Tools in chat: each invalid tools, tool_choice or message shape gets a 400 naming its field; the structural tag
each tool_choice makes (and xgrammar compiles it and holds the output to calls); the parser that reads calls out of
the text, whole and in every split of a stream; the prompt a model without tool support gets; and the responses,
whole and streamed, against a fake core."""

import json
import random
import re
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from kvferry.common.errors import ConfigError
from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.sequence import FinishReason
from kvferry.common.text_tokenizer import TextTokenizer
from kvferry.services.gateway.api import Api
from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.chat_messages import checked_messages
from kvferry.services.gateway.flight import Event
from kvferry.services.gateway.tool_calls import ToolCallParser, delta_pieces, parse_tool_calls
from kvferry.services.gateway.tool_prompt import DEFAULT_TOOL_PROMPT, ToolPrompt, for_template
from kvferry.services.gateway.tools import MAX_TOOLS, parse_tools
from tests.gateway_api import in_process_api

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMETERS}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "get_time"}}
NO_PARAMETERS = '{"type":"object","properties":{}}'
WEATHER_SPEC = json.dumps(WEATHER_PARAMETERS, separators=(",", ":"))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CLOCK_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def rules(body: dict):
    return Api.output_rules({"messages": [], **body}, True)


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        rules(body)
    assert caught.value.status == 400
    return caught.value


# -- the request -------------------------------------------------------------------------------------------------
def tool(name="f", **function):
    return {"type": "function", "function": {"name": name, **function}}


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"tools": {"f": 1}}, "tools", "must be list"),
        ({"tools": [tool(f"f{i}") for i in range(MAX_TOOLS + 1)]}, "tools", f"at most {MAX_TOOLS}"),
        ({"tools": ["f"]}, "tools[0]", '"type": "function"'),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0]", '"type": "function"'),
        ({"tools": [{**tool(), "extra": 1}]}, "tools[0].extra", "unknown field"),
        ({"tools": [tool(returns={})]}, "tools[0].function.returns", "unknown field"),
        ({"tools": [tool("a b")]}, "tools[0].function.name", "1 to 64"),
        ({"tools": [tool("x" * 65)]}, "tools[0].function.name", "1 to 64"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "1 to 64"),
        ({"tools": [tool("f"), tool("f")]}, "tools[1].function.name", "two tools"),
        ({"tools": [tool(description=1)]}, "tools[0].function.description", "str"),
        ({"tools": [tool(strict="no")]}, "tools[0].function.strict", "bool"),
        ({"tools": [tool(parameters="{}")]}, "tools[0].function.parameters", "JSON Schema object"),
        ({"tools": [tool(parameters={"type": "string"})]}, "tools[0].function.parameters", "JSON object"),
        ({"tools": [tool(parameters={"type": ["object", "null"]})]}, "tools[0].function.parameters", "no other 'type'"),
        ({"tools": [tool(parameters={"enum": ["a", "b"]})]}, "tools[0].function.parameters", "not by 'enum'"),
        ({"tools": [tool(parameters={"const": 3})]}, "tools[0].function.parameters", "not by 'const'"),
        ({"tools": [tool(parameters={"anyOf": [{"type": "string"}]})]}, "tools[0].function.parameters", "not by 'anyOf'"),
        ({"tools": [tool(parameters={"oneOf": [{"type": "object"}]})]}, "tools[0].function.parameters", "not by 'oneOf'"),
        ({"tools": [tool(parameters={"$defs": {"a": {"type": "object"}}, "$ref": "#/$defs/a"})]},
         "tools[0].function.parameters", "not by '$ref'"),
        ({"tools": [tool(parameters={"type": "object", "enum": [{}]})]}, "tools[0].function.parameters", "not by 'enum'"),
        ({"tools": [tool(parameters={"properties": {f"p{i}": {"type": "integer"} for i in range(129)}})]},
         "tools[0].function.parameters", "tools[0].function.parameters: an object with more than 128 optional"),
        ({"tools": [tool(parameters={"type": "object", "properties": {"a": {"type": 3}}})]},
         "tools[0].function.parameters", "not a valid JSON Schema"),
        ({"tools": [tool(parameters={"type": "object", "properties": {"a": {"type": "string", "format": "iri"}}})]},
         "tools[0].function.parameters", "tools[0].function.parameters.properties.a: the format 'iri' is not supported"),
        ({"tools": [tool(parameters={"type": "object", "description": "x" * (1 << 17)})]},
         "tools[0].function.parameters", "bytes"),
        ({"tools": [tool(parameters={"type": "object", "description": "x" * 70_000}),
                    tool("g", parameters={"type": "object", "description": "x" * 70_000})]}, "tools", "bytes"),
        ({"tool_choice": "auto"}, "tool_choice", "needs 'tools'"),
        ({"tool_choice": "required", "tools": []}, "tool_choice", "needs 'tools'"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "not in 'tools'"),
        ({"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not in 'tools'"),
        ({"tools": [tool()], "tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tools": [tool()], "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
        ({"tools": [tool()], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "bool"),
    ],
)  # fmt: skip
def test_invalid_tools_get_a_400_naming_their_field(body, param, says):
    error = refused(body)
    assert error.param == param and says in error.message, error.message


def test_a_call_of_a_tool_whose_arguments_may_be_no_object_is_refused_not_left_unparsable():
    """Such a tool's call under "required" would be {"name": "f", "arguments": "a"}, which no parser reads as a call."""
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": "a"}\n</tool_call>')[1] == []
    assert refused({"tools": [tool(parameters={"enum": ["a"]})], "tool_choice": "required"}).param == (
        "tools[0].function.parameters"
    )


def test_the_tools_size_together_is_checked_before_any_schema_is_walked():
    """A body of many large tools is refused by its size at once, not after each schema's metaschema and support
    walks (seconds each for some schemas); so the first tool's unsupported keyword is never reached."""
    big = [tool(f"f{i}", parameters={"type": "object", "not": {}, "description": "x" * 50_000}) for i in range(3)]
    error = refused({"tools": big})
    assert error.param == "tools" and "bytes together" in error.message, error.message
    assert refused({"tools": big[:1]}).param == "tools[0].function.parameters"  # alone, it is walked


def test_tools_are_a_chat_field_only():
    with pytest.raises(ApiError) as caught:
        Api.output_rules({"prompt": "x", "tools": [WEATHER]}, False)
    assert caught.value.param == "tools" and "unknown parameter" in caught.value.message


def tag(name: str, spec: str) -> str:
    begin = json.dumps(f'<tool_call>\n{{"name": "{name}", "arguments": ', ensure_ascii=False)
    return f'{{"type":"tag","begin":{begin},"content":{{"type":"json_schema","json_schema":{spec},"max_whitespace_cnt":1}},"end":"}}\\n</tool_call>"}}'  # noqa: E501


TAGS = f"[{tag('get_weather', WEATHER_SPEC)},{tag('get_time', NO_PARAMETERS)}]"


@pytest.mark.parametrize(
    "extra, field, form",
    [
        ({}, "tools", f'{{"type":"triggered_tags","triggers":["<tool_call>"],"tags":{TAGS},"at_least_one":false,"stop_after_first":false}}'),  # noqa: E501
        ({"parallel_tool_calls": False}, "tools", f'{{"type":"triggered_tags","triggers":["<tool_call>"],"tags":{TAGS},"at_least_one":false,"stop_after_first":true}}'),  # noqa: E501
        ({"tool_choice": "required"}, "tool_choice", f'{{"type":"tags_with_separator","tags":{TAGS},"separator":"\\n","at_least_one":true,"stop_after_first":false}}'),  # noqa: E501
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice", tag("get_time", NO_PARAMETERS)),  # noqa: E501
    ],
)  # fmt: skip
def test_each_tool_choice_makes_its_exact_structural_tag(extra, field, form):
    tools, constraint = rules({"tools": [WEATHER, CLOCK], **extra})
    assert (constraint.kind, constraint.field) == ("structural_tag", field)
    assert constraint.spec == f'{{"type":"structural_tag","format":{form}}}'
    assert tools.parallel == extra.get("parallel_tool_calls", True)


def test_tool_choice_none_constrains_nothing_and_parameters_get_an_object_type():
    tools, constraint = rules({"tools": [WEATHER], "tool_choice": "none"})
    assert constraint is None and not tools.calls_allowed
    assert rules({})[0] is None and rules({"tool_choice": "none", "parallel_tool_calls": False}) == (None, None)
    tools, _ = rules({"tools": [tool(parameters={"properties": {"a": {"type": "string"}}})]})
    assert tools.parameters["f"] == {"type": "object", "properties": {"a": {"type": "string"}}}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.tiny_models import save_tiny_chat_model

    folder = tmp_path_factory.mktemp("tiny_chat")
    save_tiny_chat_model(folder)
    return folder


@pytest.fixture(scope="module")
def compiler(tiny_folder):
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tiny_folder))
    return xgr, xgr.GrammarCompiler(info)


@pytest.mark.parametrize(
    "extra, accepted, refused_",
    [
        ({}, ["", "hello", f"hello {CALL}", f"{CALL}\n{CLOCK_CALL}", f"{CALL} and then"],
         [CALL.replace("Paris", "x" * 31), CALL.replace("get_weather", "get_wind"), CALL.replace('"city": "Paris", ', "")]),
        ({"parallel_tool_calls": False}, [f"hello {CALL}"], [f"{CALL}\n{CLOCK_CALL}", f"{CALL} and then"]),
        ({"tool_choice": "required"}, [CALL, CLOCK_CALL, f"{CALL}\n{CLOCK_CALL}"], ["", "hello", f"hello {CALL}", f"{CALL} x"]),  # noqa: E501
        ({"tool_choice": "required", "parallel_tool_calls": False}, [CALL], [f"{CALL}\n{CLOCK_CALL}"]),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, [CALL], [CLOCK_CALL, f"{CALL}\n{CALL}", "x"]),  # noqa: E501
    ],
)  # fmt: skip
def test_the_structural_tags_compile_and_hold_the_output_to_calls(compiler, extra, accepted, refused_):
    xgr, compile_ = compiler
    grammar = compile_.compile_structural_tag(rules({"tools": [WEATHER, CLOCK], **extra})[1].spec)

    def completes(text):
        matcher = xgr.GrammarMatcher(grammar)
        return matcher.accept_string(text) and matcher.is_completed()

    for text in accepted:
        assert completes(text), text
    for text in refused_:
        assert not completes(text), text


# -- reading calls out of the text ---------------------------------------------------------------------------------
ARGS = '{"city": "Pa}ris \\"{[", "n": [1, {"a": 2}]}'
OUTPUTS = [  # (text, content, [(name, arguments)])
    (f"hello {CALL}", "hello ", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (f'<tool_call>\n{{"name": "f", "arguments": {ARGS}}}\n</tool_call>', None, [("f", ARGS)]),
    (f"{CALL}\n{CLOCK_CALL}\n", None, [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", "{}")]),
    (f"Let me look. {CLOCK_CALL} Done.", "Let me look.  Done.", [("get_time", "{}")]),
    ('<tool_call>{"name":"g","arguments":{"x":1}}</tool_call>', None, [("g", '{"x":1}')]),
    ('<tool_call>\n{"arguments": {"x": 1}, "name": "g"}\n</tool_call>', None, [("g", '{"x": 1}')]),
    ('<tool_call>\n{"name": "g", "arguments": "{\\"x\\": 1}"}\n</tool_call>', None, [("g", '{"x": 1}')]),
    ("no call < tool_call> <tool_ca", "no call < tool_call> <tool_ca", []),
    ("  \n", "  \n", []),
    ("", "", []),
    ('<tool_call>\n{"name": "cut", "arguments": {"x": "ab', '<tool_call>\n{"name": "cut", "arguments": {"x": "ab', []),
    ('<tool_call>\n{"name": "g", "arguments": {"x": 1}} oops', '<tool_call>\n{"name": "g", "arguments": {"x": 1}} oops', []),
    ("<tool_call>not json</tool_call> x", "<tool_call>not json</tool_call> x", []),
    ('<tool_call>\n{"name": "g", "arguments": [1]}\n</tool_call>', '<tool_call>\n{"name": "g", "arguments": [1]}\n</tool_call>', []),
    (f"{CALL}\n<tool_call>\n{{\"name\": \"get_time\"", "\n<tool_call>\n{\"name\": \"get_time\"", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),  # noqa: E501
    ('<tool_call>\n{"name": "\\u00e9t\\u00e9", "arguments": {"é": "ü"}}\n</tool_call>', None, [("été", '{"é": "ü"}')]),
]  # fmt: skip


@pytest.mark.parametrize("text, content, calls", OUTPUTS)
def test_a_whole_output_gives_its_content_and_calls(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id) for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


def splits(text: str):
    yield [text]
    yield list(text)  # a character at a time
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rng = random.Random(len(text))
    for _ in range(30):
        pieces, at = [], 0
        while at < len(text):
            size = rng.randint(1, 12)
            pieces.append(text[at : at + size])
            at += size
        yield pieces


@pytest.mark.parametrize("text, content, calls", OUTPUTS)
def test_the_stream_gives_names_first_then_fragments_that_join_to_the_whole_arguments(text, content, calls):
    for pieces in splits(text):
        check_stream(pieces, content, calls)


PARTS = [
    "<tool_call>",
    "</tool_call>",
    "\n",
    '{"name": ',
    '"f"',
    ', "arguments": ',
    "{",
    "}",
    '"',
    "\\",
    "x",
    " ",
    "[",
    "<",
]


@settings(max_examples=500, deadline=None, database=None)
@given(st.lists(st.sampled_from(PARTS), max_size=30), st.randoms(use_true_random=False))
def test_any_text_streams_as_it_parses_whole(parts, rng):
    text = "".join(parts)
    content, calls = parse_tool_calls(text)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 5))) if len(text) > 1 else []
    check_stream(
        [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])], content, [(c.name, c.arguments) for c in calls]
    )


def check_stream(pieces: list[str], content, calls) -> None:
    """The stream of text cut into pieces: each call's name first, then fragments that join to its whole arguments;
    the same content as the whole text gives."""
    parser, deltas = ToolCallParser(), []
    for piece in pieces:
        deltas += delta_pieces(parser.feed(piece))
    deltas += delta_pieces(parser.finish())
    streamed, names = {}, {}
    for delta in deltas:
        assert len(delta) == 1 and ("content" in delta) != ("tool_calls" in delta)
        for entry in delta.get("tool_calls", []):
            if "id" in entry:  # a call's first delta: its name, no arguments yet
                assert entry["index"] not in names and entry["function"]["arguments"] == ""
                names[entry["index"]] = entry["function"]["name"]
                streamed[entry["index"]] = ""
            else:
                assert entry["index"] in names and "name" not in entry["function"]
                streamed[entry["index"]] += entry["function"]["arguments"]
    complete = [c for c in parser.calls if c.complete]
    assert [(c.name, c.arguments) for c in complete] == calls, pieces
    assert all(streamed[c.index] == c.arguments and names[c.index] == c.name for c in complete)
    streamed_content = "".join(d.get("content", "") for d in deltas)
    if complete or not parser.calls:  # beside a call cut off, the stream had sent the call's start
        assert streamed_content == (content or ""), pieces


# -- the prompt ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(tiny_folder):
    return TextTokenizer(tiny_folder)


@pytest.fixture(scope="module")
def tool_aware(tiny_folder, tmp_path_factory):
    """The same tokenizer with a chat template that renders tools and tool calls itself."""
    folder = tmp_path_factory.mktemp("tool_aware")
    for path in tiny_folder.iterdir():
        if path.name.startswith("tokenizer"):
            shutil.copy(path, folder)
    (folder / "chat_template.jinja").write_text(
        "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return TextTokenizer(folder)


def render(tokenizer, messages, body=None, prompt=None) -> str:
    tools = parse_tools(body or {})
    messages, shown = for_template(checked_messages(messages), tools, tokenizer.renders_tools, prompt or ToolPrompt())
    return tokenizer.apply_chat_template(messages, tools=shown, add_generation_prompt=True, tokenize=False)


ASK = [{"role": "user", "content": "Weather in Paris?"}]
TURNS = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "cloudy"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]  # fmt: skip


def test_a_template_without_tools_gets_them_in_the_system_prompt(smol):
    assert not smol.renders_tools
    text = render(smol, ASK, {"tools": [WEATHER, CLOCK]})
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(WEATHER["function"], ensure_ascii=False) in text and '{"name": "get_time"}' in text
    assert "<tool_call>\n" in text and "SmolLM" not in text and text.endswith("<|im_start|>assistant\n")
    required = render(smol, ASK, {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    assert "You must call at least one function." in required and "Call one function at most." in required
    named = render(
        smol, ASK, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )  # noqa: E501
    assert "You must call the function get_weather." in named
    assert render(smol, ASK, {"tools": [WEATHER], "tool_choice": "none"}) == render(smol, ASK)
    with_system = render(smol, [{"role": "system", "content": "Be brief."}, *ASK], {"tools": [WEATHER]})
    assert (
        with_system.startswith("<|im_start|>system\n# Tools\n") and "</tool_call>\n\nBe brief.<|im_end|>" in with_system
    )


def test_a_two_turn_tool_conversation_renders_without_template_support(smol):
    text = render(smol, TURNS, {"tools": [WEATHER, CLOCK]})
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"sky": "cloudy"}\n</tool_response>\n'
        "<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    assert "<|im_start|>system\n# Tools" not in render(smol, TURNS, {"tools": [WEATHER], "tool_choice": "none"})


def test_a_template_with_tools_gets_them_and_the_calls_arguments_as_data(tool_aware):
    assert tool_aware.renders_tools
    text = render(tool_aware, TURNS, {"tools": [WEATHER, CLOCK]})
    assert text.startswith("TOOLS:[") and '"get_weather"' in text and "# Tools" not in text
    assert "CALL get_weather Paris" in text and "<|im_start|>tool\n12:00" in text
    assert not render(tool_aware, ASK, {"tools": [WEATHER], "tool_choice": "none"}).startswith("TOOLS")


def test_a_tool_prompt_template_from_a_file_and_a_bad_one_stops_the_start(smol, tmp_path):
    good = tmp_path / "good.jinja"
    good.write_text("Functions: {% for t in tools %}{{ t.function.name }} {% endfor %}({{ tool_choice }})")
    text = render(smol, ASK, {"tools": [WEATHER, CLOCK]}, ToolPrompt.from_file(str(good)))
    assert "<|im_start|>system\nFunctions: get_weather get_time (auto)<|im_end|>" in text
    assert ToolPrompt.from_file(None).source == DEFAULT_TOOL_PROMPT
    for name, source in (
        ("syntax", "{% for %}"),
        ("runtime", "{{ tools.nope.deeper }}"),
        ("unsafe", "{{ ''.__class__.__mro__ }}"),
    ):
        bad = tmp_path / f"{name}.jinja"
        bad.write_text(source)
        with pytest.raises(ConfigError, match="tool-prompt-template"):
            ToolPrompt.from_file(str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        ToolPrompt.from_file(str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "tool", "tool_call_id": "c"}], "messages[0].content"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ([{"role": "assistant", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": None, "tool_calls": []}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": []}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": {"id": "c"}}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": ["c"]}], "messages[0].tool_calls[0]"),
        ([{"role": "assistant", "tool_calls": [{"type": "retrieval", "function": {}}]}], "messages[0].tool_calls[0]"),
        ([{"role": "assistant", "tool_calls": [{"id": 1, "function": {"name": "f", "arguments": "{}"}}]}], "messages[0].tool_calls[0].id"),  # noqa: E501
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "messages[0].tool_calls[0].function.name"),  # noqa: E501
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}], "messages[0].tool_calls[0].function.arguments"),  # noqa: E501
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], "messages[0].tool_calls[0].function.arguments"),  # noqa: E501
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}]}], "messages[0].tool_calls[0].function.arguments"),  # noqa: E501
        ([{"role": "user"}], "messages[0].content"),
        ([{"content": "x"}], "messages[0]"),
        ([], "messages"),
    ],
)  # fmt: skip
def test_a_message_of_the_wrong_shape_gets_a_400_naming_it(messages, param):
    with pytest.raises(ApiError) as caught:
        checked_messages(messages)
    assert (caught.value.status, caught.value.param) == (400, param), caught.value.message


def test_an_assistant_call_with_data_arguments_and_content_renders(smol):
    messages = [*ASK, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "12:00"}]}]  # fmt: skip
    text = render(smol, messages)
    assert 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text


# -- the responses -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def api():
    with in_process_api(GatewayConfig(max_n=4)) as served_api:
        yield served_api


@pytest.fixture
def served(api, monkeypatch):
    """A client, and outputs (one text per choice) the fake workers answer with, a few tokens per event."""
    outputs: list[tuple[str, FinishReason]] = []
    received = []

    async def generate_batches(prompt_ids, params, request_id=None, trace=None, n=1, flights=None):
        received.append((prompt_ids, params))
        ids = [api.tokenizer.encode(text, add_special_tokens=False) for text, _ in outputs]
        for at in range(0, max(map(len, ids)), 3):  # the choices' events interleaved
            for choice, (tokens, (_, reason)) in enumerate(zip(ids, outputs)):
                if at < len(tokens):
                    last = at + 3 >= len(tokens)
                    yield [Event(tokens[at : at + 3], reason if last else None, choice, at)]

    monkeypatch.setattr(api.core, "generate_batches", generate_batches)
    return TestClient(api.app(), raise_server_exceptions=False), outputs, received


def ask(client, stream=False, **extra):
    body = {"messages": ASK, "tools": [WEATHER, CLOCK], "max_tokens": 200, "stream": stream, **extra}
    return client.post("/v1/chat/completions", json=body)


def test_a_whole_response_carries_the_calls_and_finishes_tool_calls(api, served):
    client, outputs, received = served
    outputs.append((f"{CALL}\n{CLOCK_CALL}", FinishReason.STOP))
    reply = ask(client, tool_choice="required")
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("function", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
        ("function", "get_time", "{}"),
    ]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c["id"]) for c in calls)
    prompt_ids, params = received[-1]
    assert params.constraint.kind == "structural_tag" and params.constraint.field == "tool_choice"
    assert "get_weather" in api.tokenizer.decode(prompt_ids)


def test_text_without_calls_and_a_call_cut_off_stay_text(served):
    client, outputs, _ = served
    outputs.append(("It is sunny.", FinishReason.STOP))
    choice = ask(client).json()["choices"][0]
    assert choice == {**choice, "finish_reason": "stop", "message": {"role": "assistant", "content": "It is sunny."}}
    outputs[:] = [(CALL[:40], FinishReason.LENGTH)]
    choice = ask(client).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == CALL[:40]
    assert "tool_calls" not in choice["message"]
    outputs[:] = [(CALL, FinishReason.STOP)]
    choice = ask(client, tool_choice="none").json()["choices"][0]  # not read for calls: the text as it is
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == CALL


def test_a_stream_of_n_choices_sends_each_calls_name_then_its_arguments(served):
    client, outputs, _ = served
    outputs += [(f"Sure. {CALL}", FinishReason.STOP), (f"{CLOCK_CALL}\n{CALL}", FinishReason.STOP)]
    reply = ask(client, stream=True, n=2)
    assert reply.status_code == 200
    lines = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    content, calls, finish = {0: "", 1: ""}, {0: {}, 1: {}}, {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            i, delta = choice["index"], choice["delta"]
            content[i] += delta.get("content") or ""
            for entry in delta.get("tool_calls", []):
                if "id" in entry:
                    calls[i][entry["index"]] = [entry["function"]["name"], ""]
                calls[i][entry["index"]][1] += entry["function"]["arguments"]
            if choice["finish_reason"]:
                finish[i] = choice["finish_reason"]
    weather = ["get_weather", '{"city": "Paris", "unit": "celsius"}']
    assert content == {0: "Sure. ", 1: ""} and finish == {0: "tool_calls", 1: "tool_calls"}
    assert calls == {0: {0: weather}, 1: {0: ["get_time", "{}"], 1: weather}}


def test_the_documented_default_tool_prompt_is_the_one_in_the_code():
    from pathlib import Path

    docs = Path(__file__).parents[2] / "docs" / "structured-output.md"
    assert DEFAULT_TOOL_PROMPT in docs.read_text(encoding="utf-8")
