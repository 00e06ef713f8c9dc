"""The `dsjax` command line: logits (table and JSON), info, convert's refusal to overwrite, --help of every
subcommand, exit code 2 with "error:" on stderr for bad input, and the installed console script."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import dsjax
from dsjax import cli
from dsjax.weights import nbytes

CONFIGS = os.path.join(os.path.dirname(__file__), "data", "configs")


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_logits_json(capsys):
    rc, out, err = run(capsys, "logits", "--prompt", "hello", "--json", "--model", "tiny-v4", "--top", "5")
    assert rc == 0, err
    result = json.loads(out)
    assert result["model"].startswith("preset:tiny-v4") and "random weights" in result["model"]
    assert result["prompt_ids"] and all(isinstance(i, int) for i in result["prompt_ids"])
    from dsjax.tokenizer import load_tokenizer
    assert result["prompt_ids"] == load_tokenizer("v4").encode("hello")
    top = result["top"]
    assert len(top) == 5
    assert all(set(t) == {"id", "text", "logprob"} for t in top)
    ids = [t["id"] for t in top]
    assert len(set(ids)) == 5 and all(0 <= i < 129280 for i in ids)
    logprobs = [t["logprob"] for t in top]
    assert logprobs == sorted(logprobs, reverse=True) and all(lp <= 0 for lp in logprobs)
    assert result["load_s"] >= 0 and result["forward_s"] >= 0
    # the same numbers as the Python API, same seed
    model = dsjax.load("tiny-v4")
    ids_in = result["prompt_ids"]
    logits = np.asarray(model.logits([ids_in], positions=[len(ids_in) - 1]))[0, -1]  # the CLI's compiled call
    logp = logits - np.logaddexp.reduce(logits)
    assert ids == [int(i) for i in np.argsort(-logits)[:5]]
    np.testing.assert_allclose(logprobs, logp[ids], rtol=1e-5, atol=1e-5)


def test_info_preset(capsys):
    rc, out, err = run(capsys, "info", "v4-flash")
    assert rc == 0, err
    info = json.loads(out)
    assert info["weight_bytes"] == nbytes(dsjax.preset("v4-flash"))
    assert (info["dim"], info["n_layers"], info["n_routed_experts"], info["expert_dtype"]) == (4096, 43, 256, "fp4")
    assert info["layer_kinds"][:4] == ["window", "window", "csa", "hca"] and len(info["layer_kinds"]) == 43


def test_info_config_path(capsys):
    rc, out, err = run(capsys, "info", os.path.join(CONFIGS, "deepseek-v4-flash.config.json"))
    assert rc == 0, err
    info = json.loads(out)
    assert info["weight_bytes"] == nbytes(dsjax.preset("v4-flash"))
    assert info["compress_ratios"] == list(dsjax.preset("v4-flash").compress_ratios)


def test_info_takes_what_model_takes(capsys, tmp_path, monkeypatch):
    """`info` resolves its argument as `--model` does: the bundled dsjax-small (by name, or as a relative
    directory), a directory holding only config.json; a directory without config.json is refused clearly."""
    from dsjax.assets import bundled_path

    rc, out, err = run(capsys, "info", "dsjax-small")
    assert rc == 0, err
    info = json.loads(out)
    want = dsjax.load_config(bundled_path("dsjax-small"))
    assert info["name"] == "dsjax-small" and info["dim"] == want.dim and info["n_layers"] == want.n_layers
    assert info["weight_bytes"] == nbytes(want)
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    (only_config / "config.json").write_text(open(os.path.join(CONFIGS, "deepseek-v4-flash.config.json")).read())
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, "info", "only-config")                  # relative, no "/": a directory all the same
    assert rc == 0, err
    assert json.loads(out)["weight_bytes"] == nbytes(dsjax.preset("v4-flash"))
    (tmp_path / "empty").mkdir()
    rc, out, err = run(capsys, "info", "empty")
    assert rc == 2 and "no config.json found" in err


def test_info_v41(capsys):
    """V4.1's weight tree (Engram tables and DSpark included): info prints the config and its weight bytes."""
    rc, out, err = run(capsys, "info", "v4.1-flash")
    assert rc == 0, err
    info = json.loads(out)
    assert info["family"] == "v4.1" and info["dim"] == 5120 and info["weight_bytes"] == nbytes(dsjax.preset("v4.1-flash"))


@pytest.mark.parametrize("argv,needle", [
    (["logits", "--prompt", "hi", "--model", "no-such-model"], "'no-such-model' is neither a directory, a bundled checkpoint (dsjax-small) nor a known preset"),
    (["logits", "--prompt", "hi", "--model", "v4-flash"], "GiB"),
    (["logits", "--prompt", "hi", "--model", "v4.1-flash"], "GiB"),
    (["info", "no-such-model"], "'no-such-model' is neither a directory, a bundled checkpoint (dsjax-small) nor a known preset"),
    (["info", "/no/such/dir"], "'/no/such/dir' is neither a directory"),
])
def test_errors_exit_2(capsys, argv, needle):
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert err.startswith("error: ") and needle in err, err
    assert "Traceback" not in err and out == ""


def test_convert_refuses_to_overwrite(capsys, tmp_path, test_seed):
    from dsjax.params import init_params
    cfg = dsjax.preset("tiny-v4", vocab_size=256, n_layers=1, compress_ratios=(4, 0), n_hash_layers=1)
    src = str(tmp_path / "src")
    dsjax.save_checkpoint(init_params(cfg, test_seed), cfg, src)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    rc, out, err = run(capsys, "convert", src, str(dst))
    assert rc == 2 and "refusing to overwrite a non-empty directory" in err
    assert (dst / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("command,flags", [
    ([], ["logits", "convert", "info"]),
    (["logits"], ["next tokens", "--prompt", "--model", "--numerics", "seed", "--top", "--json", "reference-fp8",
                  "preset"]),
    (["convert"], ["Orbax", "src", "dst"]),
    (["info"], ["weight", "model", "preset name", "config.json"]),
])
def test_help(capsys, command, flags):
    with pytest.raises(SystemExit) as e:
        cli.main(command + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dsjax")
    for flag in flags:
        assert flag in out, (flag, out)


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["logits"])  # --prompt is required
    assert e.value.code == 2
    assert "--prompt" in capsys.readouterr().err


def test_console_script():
    exe = shutil.which("dsjax", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip(f"no `dsjax` console script beside {sys.executable}: the package is not pip-installed in this "
                    f"environment (`pip install -e .` installs it)")
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "logits" in proc.stdout and "convert" in proc.stdout and "info" in proc.stdout
    proc = subprocess.run([exe, "info", "no-such-model"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ")


def test_python_dash_m():
    """`python -m dsjax` is the same command line (no console script needed): its help, and a usage error's code."""
    proc = subprocess.run([sys.executable, "-m", "dsjax", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: dsjax ") and "generate" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "dsjax", "logits"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--prompt" in proc.stderr
