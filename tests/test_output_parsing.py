"""Incremental parsing of generated text into reasoning / content / tool calls; never raises."""

import json
import random

import pytest

from dsjax.chat import OutputParser, encode_messages, parse_output
from dsjax.tokenizer import EOS, load_tokenizer

V4_CALLS = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">杭州</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n<｜DSML｜invoke name="add">\n'
            '<｜DSML｜parameter name="x" string="false">[1.5, {"a": null}]</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
V41_CALLS = (V4_CALLS.replace("｜DSML｜tool_calls", "｜DSML｜ calls").replace("｜DSML｜invoke", "｜DSML｜ invoke")
             .replace("｜DSML｜parameter", "｜DSML｜ parameter"))
EXPECTED_CALLS = [("get_weather", '{"city": "杭州", "days": 3}'), ("add", '{"x": [1.5, {"a": null}]}')]


def calls(parsed):
    return [(c.name, c.arguments) for c in parsed.tool_calls]


def summary(parsed):
    return parsed.reasoning, parsed.content, calls(parsed), parsed.ended, sorted(parsed.errors)


@pytest.mark.parametrize("family,block", [("v4", V4_CALLS), ("v4.1", V41_CALLS)])
def test_reasoning_content_and_calls(family, block):
    parsed = parse_output("Think 😀.</think>Let me check." + block + EOS, family=family, thinking=True)
    assert (parsed.reasoning, parsed.content, parsed.ended, parsed.errors) == ("Think 😀.", "Let me check.", True, [])
    assert calls(parsed) == EXPECTED_CALLS
    assert parsed.tool_calls[1].parsed_arguments() == {"x": [1.5, {"a": None}]}


def test_chat_mode_has_no_reasoning():
    parsed = parse_output("Plain answer." + EOS, family="v4", thinking=False)
    assert (parsed.reasoning, parsed.content, parsed.errors) == ("", "Plain answer.", [])


@pytest.mark.parametrize("family", ["v4", "v4.1"])
@pytest.mark.parametrize("thinking", [True, False])
def test_round_trip_through_the_encoder(family, thinking):
    """An assistant turn rendered by our encoder parses back to the same message."""
    arguments = {"q": "多语言 😀", "n": 2, "flags": [True, None], "nested": {"a": "b\nc"}, "empty": ""}
    call = {"id": "c1", "type": "function",
            "function": {"name": "lookup", "arguments": json.dumps(arguments, ensure_ascii=False)}}
    turn = {"role": "assistant", "content": "Answer\n\nwith lines", "reasoning_content": "why\n", "tool_calls": [call]}
    prompt = encode_messages([{"role": "user", "content": "q"}, turn], family=family, thinking=thinking,
                             drop_thinking=False)
    header = "<｜Assistant｜>" + ("<think>" if thinking else "</think>")
    parsed = parse_output(prompt[prompt.rfind(header) + len(header):], family=family, thinking=thinking)
    assert parsed.errors == [] and parsed.ended
    assert parsed.reasoning == ("why\n" if thinking else "")
    assert parsed.content == "Answer\n\nwith lines"
    assert calls(parsed) == [("lookup", call["function"]["arguments"])]


def test_token_by_token_stream_matches_whole_parse():
    tok = load_tokenizer("v4.1")
    text = "推理 😀 step</think>Result: 中文" + V41_CALLS + EOS
    parser = OutputParser("v4.1", thinking=True, tokenizer=tok)
    events = []
    for token_id in tok.encode(text):
        events += parser.feed_ids([token_id])
    events += parser.flush()
    result = parser.finish()
    assert result == parse_output(text, family="v4.1", thinking=True)
    assert all("\ufffd" not in e.text for e in events)
    kinds = [e.kind for e in events]
    assert kinds == sorted(kinds, key=["reasoning", "content", "tool_call"].index)  # phases never interleave
    assert "".join(e.text for e in events if e.kind == "reasoning") == "推理 😀 step"
    assert [e.tool_call.name for e in events if e.kind == "tool_call"] == ["get_weather", "add"]


def test_text_is_held_back_only_while_ambiguous():
    parser = OutputParser("v4", thinking=False)
    assert [e.text for e in parser.feed("Hello")] == ["Hello"]
    assert parser.feed("\n\n") == []  # might be the gap before a tool-call block
    assert parser.feed("<") == []
    assert parser.feed("｜DSML｜") == []
    assert parser.feed("tool_calls>\n") == []
    events = parser.feed('<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n')
    assert [(e.kind, e.tool_call.name) for e in events] == [("tool_call", "f")]
    parser = OutputParser("v4", thinking=False)
    parser.feed("a\n\n")
    assert [e.text for e in parser.feed("b")] == ["\n\nb"]  # not a block after all: released at once


@pytest.mark.parametrize("text,thinking,expect", [
    # truncated inside reasoning (e.g. max_tokens)
    ("still thinking", True, dict(reasoning="still thinking", errors=["output ended inside reasoning (no </think>)"])),
    # truncated inside a tool call: the complete call is kept, the broken one dropped
    ('ok</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="a">\n</｜DSML｜invoke>\n<｜DSML｜invoke name="b">\n'
     '<｜DSML｜parameter name="p" string="true">unfinish', True,
     dict(reasoning="ok", calls=[("a", "{}")],
          errors=["output ended inside tool call 'b'; the incomplete call was dropped"])),
    # invoke never closed, block closed: read what it has
    ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="p" string="true">v</｜DSML｜ parameter>\n'
     '</｜DSML｜ calls>' + EOS, False, dict(calls=[("f", '{"p": "v"}')], errors=["tool call 'f' not closed"])),
    # tool calls written inside an unclosed reasoning block
    ('plan\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>' + EOS, True,
     dict(reasoning="plan", calls=[("f", "{}")], errors=["tool calls began inside reasoning (no </think>)"])),
    # JSON-typed value that is not JSON; missing string attribute; no blank line before the block
    ('x</think><｜DSML｜tool_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="a" string="false">not json'
     '</｜DSML｜parameter><｜DSML｜parameter name="b">7</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>', True,
     dict(reasoning="x", calls=[("f", '{"a": "not json", "b": 7}')],
          errors=["tool call 'f': parameter 'a' is marked JSON but is not; kept as a string",
                  "tool call 'f': parameter 'b' has no string attribute"])),
    # text after the block, then text after EOS
    ('<｜DSML｜tool_calls><｜DSML｜invoke name="f"></｜DSML｜invoke></｜DSML｜tool_calls>\nmore' + EOS + "junk", False,
     dict(content="more", calls=[("f", "{}")],
          errors=["text after the tool-call block was kept as content", "text after EOS was ignored"])),
    # garbage inside the block and an unnamed invoke
    ('<｜DSML｜ calls>\nnoise<｜DSML｜ invoke>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>', False,
     dict(calls=[("", "{}")], errors=["ignored text in tool-call block: 'noise'", "a tool call has no name"])),
    # a repeated <think> at the start is skipped; in chat mode it opens reasoning
    ("<think>r</think>c", True, dict(reasoning="r", content="c")),
    ("<think>r</think>c", False, dict(reasoning="r", content="c",
                                      errors=["a <think> block in chat mode was read as reasoning"])),
    ("", True, dict(errors=["output ended inside reasoning (no </think>)"])),
    ("", False, dict()),
])
def test_malformed_output_gives_a_clear_result(text, thinking, expect):
    parsed = parse_output(text, family="v4", thinking=thinking)
    assert parsed.reasoning == expect.get("reasoning", "")
    assert parsed.content == expect.get("content", "")
    assert calls(parsed) == expect.get("calls", [])
    assert parsed.errors == expect.get("errors", [])


PIECES = ["abc", "\n", "\n\n", " ", "42", "[1,", '"', ">", "<", "世界😀", "</think>", "<think>", EOS, "｜DSML｜",
          "<｜DSML｜tool_calls>", "<｜DSML｜ calls>", "</｜DSML｜tool_calls>", "</｜DSML｜ calls>",
          '<｜DSML｜invoke name="f">', '<｜DSML｜ invoke name="g">', "</｜DSML｜invoke>", "</｜DSML｜ invoke>",
          '<｜DSML｜parameter name="p" string="true">', '<｜DSML｜ parameter name="q" string="false">',
          '<｜DSML｜parameter name="r">', "</｜DSML｜parameter>", "</｜DSML｜ parameter>"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_output_never_raises_and_chunking_does_not_matter(seed):
    rng = random.Random(seed)
    for case in range(400):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 25)))
        thinking = rng.random() < 0.5
        whole = parse_output(text, family="v4.1", thinking=thinking)
        parser = OutputParser("v4.1", thinking)
        start = 0
        while start < len(text):
            step = rng.randint(1, 6)
            parser.feed(text[start:start + step])
            start += step
        streamed = parser.finish()
        assert summary(streamed) == summary(whole), f"seed {seed} case {case}: {text!r}"


def test_feed_after_finish_and_feed_ids_without_tokenizer():
    parser = OutputParser("v4", thinking=False)
    parser.feed("a")
    assert parser.finish().content == "a"
    assert parser.feed("b") == [] and parser.finish().content == "a"
    assert "text fed after finish() was ignored" in parser.finish().errors
    with pytest.raises(ValueError, match="needs a tokenizer"):
        OutputParser("v4").feed_ids([1])
    with pytest.raises(ValueError, match="unknown model family"):
        OutputParser("v5")
