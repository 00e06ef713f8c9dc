"""`dsjax generate` and `dsjax chat` end to end, as a user runs them (subprocesses, the real tokenizer)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, stdin=None):
    return subprocess.run([sys.executable, "-m", "dsjax.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=600, cwd=REPO)


def test_generate_json_and_text():
    out = _run(["generate", "--prompt", "Hello there", "--max-new-tokens", "6", "--json"])
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert len(res["token_ids"]) == 6 and res["prompt_ids"][0] == 0
    assert set(res["stats"]) >= {"tokens", "tokens_per_s", "ttft_s"} and res["stats"]["tokens"] == 6
    out = _run(["generate", "--prompt", "Hello there", "--max-new-tokens", "6", "--chat", "--temperature", "1.0"])
    assert out.returncode == 0, out.stderr
    assert "random weights" in out.stderr and "6 tokens at" in out.stderr and "first token after" in out.stderr


def test_generate_speculative_mtp():
    out = _run(["generate", "--prompt", "Hello there", "--max-new-tokens", "5", "--json", "--speculative", "mtp",
                "--draft-tokens", "2"])
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) == 5


def test_chat_multi_turn_with_thinking_toggle():
    out = _run(["chat", "--max-new-tokens", "4"], stdin="hello\n/think\nand now?\n/reset\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("assistant> ") == 2
    assert "[thinking on]" in out.stderr


def test_bad_input_exits_with_a_message():
    out = _run(["generate", "--prompt", "hi", "--top-p", "0"])
    assert out.returncode == 2 and "top_p" in out.stderr
    out = _run(["generate", "--prompt", "hi", "--max-seq-len", "2"])
    assert out.returncode == 2 and "max_seq_len" in out.stderr
