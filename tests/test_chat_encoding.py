"""V4 / V4.1 chat encoding against DeepSeek's official vectors and published V4.1 prompts."""

import json
import os

import pytest

from dsjax.chat import ChatEncodingError, encode_messages, encode_messages_to_ids, parse_output
from dsjax.tokenizer import BOS, EOS, load_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data", "encoding", "v4")
EFFORT_75 = "<｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


def official_case(n):
    """Messages and golden prompt of official case n, prepared as encoding/test_encoding_dsv4.py does."""
    with open(os.path.join(DATA, f"test_input_{n}.json"), encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, dict):
        messages = data["messages"]
        messages[0]["tools"] = data["tools"]
    else:
        messages = data
    with open(os.path.join(DATA, f"test_output_{n}.txt"), encoding="utf-8") as f:
        return messages, f.read()


OFFICIAL_MODES = {1: True, 2: True, 3: True, 4: False}  # thinking mode per official case


@pytest.mark.parametrize("case", sorted(OFFICIAL_MODES))
def test_official_v4_vectors(case):
    messages, golden = official_case(case)
    assert encode_messages(messages, family="v4", thinking=OFFICIAL_MODES[case]) == golden


def test_official_v4_parse_checks():
    """The parse assertions of encoding/test_encoding_dsv4.py, run through our parser."""
    messages, prompt = official_case(1)
    marker = "<｜Assistant｜><think>"
    start = prompt.find(marker) + len(marker)
    first = parse_output(prompt[start:prompt.find("<｜User｜>", start)], family="v4", thinking=True)
    assert first.reasoning == "The user wants to know the weather in Beijing. I should use the get_weather tool."
    assert first.content == "" and first.errors == []
    assert [c.name for c in first.tool_calls] == ["get_weather"]
    assert first.tool_calls[0].parsed_arguments() == {"location": "Beijing", "unit": "celsius"}
    last = parse_output(prompt[prompt.rfind(marker) + len(marker):], family="v4", thinking=True)
    assert last.reasoning == "Got the weather data. Let me format a nice response."
    assert "22°C" in last.content and last.tool_calls == [] and last.ended

    _, prompt = official_case(2)
    parsed = parse_output(prompt[prompt.rfind(marker) + len(marker):], family="v4", thinking=True)
    assert parsed.reasoning == "The user asks about the capital of France. It is Paris."
    assert parsed.content == "The capital of France is Paris."
    assert "The user said hello" not in prompt


def test_readme_quick_start():
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 2+2?"}]
    assert encode_messages(messages, family="v4", thinking=True) == (
        BOS + "You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>")
    parsed = parse_output("Simple arithmetic.</think>2 + 2 = 4." + EOS, family="v4", thinking=True)
    assert parsed.to_openai_message() == {"role": "assistant", "reasoning_content": "Simple arithmetic.",
                                          "content": "2 + 2 = 4."}


# ---- V4 options ----

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
        {"role": "user", "content": "bye"}]


def test_v4_thinking_on_and_off():
    assert encode_messages(CHAT, family="v4", thinking=False) == (
        BOS + "<｜User｜>hi<｜Assistant｜></think>hello" + EOS + "<｜User｜>bye<｜Assistant｜></think>")
    assert encode_messages(CHAT, family="v4", thinking=True) == (
        BOS + "<｜User｜>hi<｜Assistant｜></think>hello" + EOS + "<｜User｜>bye<｜Assistant｜><think>")
    assert encode_messages(CHAT, family="v4", thinking=True, drop_thinking=False) == (
        BOS + "<｜User｜>hi<｜Assistant｜><think>greet</think>hello" + EOS + "<｜User｜>bye<｜Assistant｜><think>")


def test_v4_reasoning_effort():
    plain = encode_messages(CHAT, family="v4", thinking=True)
    assert encode_messages(CHAT, family="v4", thinking=True, reasoning_effort="high") == plain
    maxed = encode_messages(CHAT, family="v4", thinking=True, reasoning_effort="max")
    assert maxed.startswith(BOS + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert maxed.endswith("unchecked.\n\n<｜User｜>hi" + plain[len(BOS + "<｜User｜>hi"):])
    assert encode_messages(CHAT, family="v4", thinking=False, reasoning_effort="max") == encode_messages(
        CHAT, family="v4", thinking=False)
    with pytest.raises(ChatEncodingError, match="reasoning_effort 'low' is not valid for DeepSeek-V4"):
        encode_messages(CHAT, family="v4", thinking=True, reasoning_effort="low")


def test_v4_request_tools_go_on_the_system_message():
    messages, golden = official_case(1)
    tools = messages[0].pop("tools")
    assert encode_messages(messages, family="v4", thinking=True, tools=tools) == golden
    bare = encode_messages([{"role": "user", "content": "hi"}], family="v4", thinking=False, tools=[WEATHER_TOOL])
    assert bare.startswith(BOS + "\n\n## Tools\n\n") and bare.endswith("<｜User｜>hi<｜Assistant｜></think>")


def test_v4_tool_results_follow_call_order():
    calls = [{"id": i, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
             for i, c in (("a", "Paris"), ("b", "Oslo"))]
    prompt = encode_messages([{"role": "user", "content": "weather?"}, {"role": "assistant", "tool_calls": calls},
                              {"role": "tool", "tool_call_id": "b", "content": "cold"},
                              {"role": "tool", "tool_call_id": "a", "content": "warm"}],
                             family="v4", thinking=False)
    assert prompt.endswith(EOS + "<｜User｜><tool_result>warm</tool_result>\n\n<tool_result>cold</tool_result>"
                           "<｜Assistant｜></think>")
    assert '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Oslo' in prompt


def test_add_generation_prompt_false():
    prompt = encode_messages(CHAT, family="v4", thinking=True, add_generation_prompt=False)
    assert prompt == encode_messages(CHAT, family="v4", thinking=True)[:-len("<｜Assistant｜><think>")]


# ---- V4.1 ----

def to_v41(v4_prompt, lead):
    """A V4 golden rewritten by the V4 -> V4.1 differences: spaced DSML tag names, `lead` after BOS."""
    for old, new in (("｜DSML｜tool_calls", "｜DSML｜ calls"), ("｜DSML｜invoke", "｜DSML｜ invoke"),
                     ("｜DSML｜parameter", "｜DSML｜ parameter")):
        v4_prompt = v4_prompt.replace(old, new)
    return BOS + lead + v4_prompt[len(BOS):]


@pytest.mark.parametrize("case", [1, 2, 4])
def test_v41_from_official_v4_vectors(case):
    """Thinking cases gain `<｜System｜>` + the default effort line; the chat case only `<｜System｜>`."""
    messages, golden = official_case(case)
    thinking = OFFICIAL_MODES[case]
    lead = EFFORT_75 if thinking else "<｜System｜>"
    assert encode_messages(messages, family="v4.1", thinking=thinking) == to_v41(golden, lead)


def test_v41_chat_mode_keeps_system_token_without_effort():
    messages, _ = official_case(2)
    assert encode_messages(messages, family="v4.1", thinking=False) == (
        BOS + "<｜System｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I help you?"
        + EOS + "<｜User｜>What is the capital of France?<｜Assistant｜></think>The capital of France is Paris." + EOS)


def test_v41_published_prompts():
    # Prompts from independent public ports of V4.1 encoding/encoding.py (a Rust crate's unit tests, a C
    # renderer's tests, the "W52" format notes); each was checked there against the official encoder.
    assert encode_messages([{"role": "user", "content": "hello"}], family="v4.1", thinking=False) == (
        BOS + "<｜User｜>hello<｜Assistant｜></think>")
    assert encode_messages([{"role": "user", "content": "question"}], family="v4.1", thinking=True,
                           reasoning_effort=42) == (
        BOS + "<｜System｜>Reasoning Effort: 42 (range 1-100, the higher the value, the more thorough the "
              "reasoning)\n\n<｜User｜>question<｜Assistant｜><think>")
    mid_system = [{"role": "user", "content": "old"},
                  {"role": "assistant", "content": "old answer", "reasoning_content": "private", "wo_eos": True},
                  {"role": "system", "content": "new policy"}, {"role": "user", "content": "now"}]
    assert encode_messages(mid_system, family="v4.1", thinking=True, reasoning_effort=75) == (
        BOS + EFFORT_75 + "<｜User｜>old<｜Assistant｜></think>old answer<｜System｜>new policy<｜User｜>now"
                          "<｜Assistant｜><think>")
    image = [{"role": "user", "content": [{"type": "text", "text": "inspect"},
                                          {"type": "image_url", "image_url": {"url": "/tmp/a.png"}}]}]
    assert encode_messages(image, family="v4.1", thinking=False) == (
        BOS + "<｜User｜>inspect\n\n<｜deepseek_image｜><｜Assistant｜></think>")
    with_system = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert encode_messages(with_system, family="v4.1", thinking=False) == (
        BOS + "<｜System｜>S<｜User｜>U<｜Assistant｜></think>")
    assert encode_messages(with_system, family="v4.1", thinking=True) == (
        BOS + EFFORT_75 + "S<｜User｜>U<｜Assistant｜><think>")


@pytest.mark.parametrize("effort,budget", [(None, 75), ("low", 50), ("high", 75), ("max", 100), (1, 1), (100, 100)])
def test_v41_numeric_effort(effort, budget):
    prompt = encode_messages([{"role": "user", "content": "q"}], family="v4.1", thinking=True, reasoning_effort=effort)
    assert prompt.startswith(BOS + f"<｜System｜>Reasoning Effort: {budget} (range 1-100,")
    chat = encode_messages([{"role": "user", "content": "q"}], family="v4.1", thinking=False, reasoning_effort=effort)
    assert chat == BOS + "<｜User｜>q<｜Assistant｜></think>"


@pytest.mark.parametrize("effort", [0, 101, 1.5, True, "medium", "xhigh"])
def test_v41_bad_effort(effort):
    with pytest.raises(ChatEncodingError, match="not valid for DeepSeek-V4.1"):
        encode_messages([{"role": "user", "content": "q"}], family="v4.1", thinking=False, reasoning_effort=effort)


def test_v41_mid_conversation_system_opens_the_assistant_turn():
    prompt = encode_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                              {"role": "system", "content": "be brief"}], family="v4.1", thinking=True)
    assert prompt.endswith("b" + EOS + "<｜System｜>be brief<｜Assistant｜><think>")


def test_v41_tools_and_calls_use_spaced_tags():
    call = {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    prompt = encode_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "w?"},
                              {"role": "assistant", "content": "", "tool_calls": [call]}],
                             family="v4.1", thinking=False, tools=[WEATHER_TOOL])
    assert prompt.startswith(BOS + "<｜System｜>S\n\n## Tools\n\n")
    assert 'writing a "<｜DSML｜ calls>" block' in prompt and "<｜DSML｜tool_calls>" not in prompt
    assert prompt.endswith('</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
                           '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
                           "</｜DSML｜ invoke>\n</｜DSML｜ calls>" + EOS)


def test_prompt_ids():
    ids = encode_messages_to_ids([{"role": "user", "content": "What is 2+2?"}], family="v4.1", thinking=True)
    assert ids[:2] == [0, 128799] and ids[-2:] == [128804, 128821]
    v4 = load_tokenizer("v4")
    ids = encode_messages_to_ids([{"role": "user", "content": "What is 2+2?"}], family="v4", thinking=False,
                                 tokenizer=v4)
    assert ids == [0, 128803, 3085, 344, 223, 20, 13, 20, 33, 128804, 128822]
    with pytest.raises(ValueError, match="tokenizer is for 'v4'"):
        encode_messages_to_ids(CHAT, family="v4.1", thinking=True, tokenizer=v4)


# ---- errors ----

@pytest.mark.parametrize("family,messages,match", [
    ("v4", [{"role": "wizard", "content": "x"}], r"messages\[0\]: unknown role 'wizard'"),
    ("v4.1", [{"role": "developer", "content": "x"}], "no 'developer' role"),
    ("v4", [{"content": "x"}], r"messages\[0\] must be a dict with a 'role'"),
    ("v4", [], "non-empty list"),
    ("v4", [{"role": "user", "content": "x", "task": "poem"}], "unknown task 'poem'"),
    ("v4", [{"role": "system", "content": "x", "tools": [{"name": "f"}]}], r"tools\[0\] is not an OpenAI tool"),
    ("v4", [{"role": "system", "content": "x",
             "tools": [{"type": "function", "function": {"name": "f", "parameters": "?"}}]}],
     "'parameters' must be a JSON-schema object"),
    ("v4", [{"role": "assistant", "tool_calls": [{"name": "f"}]}], r"tool_calls\[0\] must look like"),
    ("v4", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}}]}], "takes no images"),
    ("v4", [{"role": "user", "content": [{"type": "audio"}]}], "unsupported content part"),
    ("v4.1", [{"role": "user", "content": "see <｜deepseek_image｜>"}], "contains the image token"),
    ("v4", [{"role": "developer", "content": ""}], "developer message needs non-empty content"),
])
def test_bad_messages(family, messages, match):
    with pytest.raises(ChatEncodingError, match=match):
        encode_messages(messages, family=family, thinking=True)


def test_unknown_family():
    with pytest.raises(ValueError, match="unknown model family 'v3'"):
        encode_messages(CHAT, family="v3", thinking=True)
