"""`dsjax plan` against the spec's accounting: V4-Flash parameter counts (§5.2), KV bytes/token (§4.2) from the
state init_state allocates, per-device weight bytes from the sharding rules, fit decisions, and the CLI."""

import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest

from dsjax import cli, plan as planner
from dsjax.config import preset
from dsjax.errors import ConfigError
from dsjax.weights import describe, is_info


@pytest.fixture(autouse=True)
def _default_policy(monkeypatch):
    for var in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_PYTHON_CLIENT_PREALLOCATE"):
        monkeypatch.delenv(var, raising=False)


def fits(p, gpu):
    return next(g["fits"] for g in p["gpus"] if g["gpu"] == gpu)


def test_v4_flash_logical_parameters_match_the_spec():
    # logical shapes of quantised weights, no scale arrays, no tid2eid lookup table
    lp = planner.plan("v4-flash", max_seq_len=4096, batch=1)["weights"]["logical_params"]
    assert round(lp["backbone"] / 1e9, 2) == 284.33
    assert round(lp["mtp"] / 1e9, 2) == 6.61
    assert round(lp["total"] / 1e9, 2) == 290.94


def test_kv_bytes_per_token_from_allocated_state():
    cfg = preset("v4-flash")
    a, b = (planner.state_plan(cfg, 1, n)["per_device"] for n in (8192, 16384))
    assert a["window rings"] == b["window rings"] and a["compressor buffers"] == b["compressor buffers"]
    grown = sum(b.values()) - sum(a.values())
    assert grown / 8192 == 21 * (146 + 17) + 20 * 4.5625 == 3514.25
    kv = planner.kv_layout(cfg)
    assert kv["main_row"]["bytes"] == 584 and kv["index_row"]["bytes"] == 68
    assert kv["global_bytes_per_token"] == 3514.25
    assert kv["bytes_per_token"]["csa (ratio 4)"] == {"layers": 21, "main": 146, "index": 17}
    assert kv["bytes_per_token"]["hca (ratio 128)"] == {"layers": 20, "main": 4.5625}
    # fp32 caches under transformers numerics: 2048-byte main rows, 512-byte index rows
    fp32 = planner.kv_layout(cfg.with_numerics("transformers"))
    assert fp32["global_bytes_per_token"] == 21 * (2048 + 512) / 4 + 20 * 2048 / 128


def test_per_device_weights_at_tp8_follow_the_shardings():
    cfg = preset("v4-flash")
    replicated = sharded = 0
    for info in jax.tree.leaves(describe(cfg), is_leaf=is_info):
        n = math.prod(info.shape) * np.dtype(info.dtype).itemsize
        if any(cfg.sharding.spec(info.axes)):
            sharded += n
        else:
            replicated += n
    w = planner.plan("v4-flash", tp=8, max_seq_len=4096, batch=1)["weights"]
    assert w["global_total"] == sharded + replicated
    assert w["per_device_total"] == sharded // 8 + replicated
    assert 0.9e9 < w["per_device_total"] - w["global_total"] / 8 < 1.1e9  # 7/8 of ~1.17 GB replicated weights
    assert w["per_device"]["embedding"] == 129280 * 4096 * 2 // 8


def test_experts_over_all_devices_and_batch_over_dp():
    p = planner.plan("v4-flash", tp=2, dp=2, ep="all", max_seq_len=4096, batch=8)
    q = planner.plan("v4-flash", tp=2, dp=1, ep="tp", max_seq_len=4096, batch=8)
    assert p["mesh"]["experts_over"] == ["dp", "tp"]
    assert p["weights"]["per_device"]["routed experts"] * 2 == q["weights"]["per_device"]["routed experts"]
    assert p["weights"]["per_device"]["attention"] == q["weights"]["per_device"]["attention"]
    assert p["slots_per_device"] == 4 and q["slots_per_device"] == 8
    assert planner.plan("v4-flash", tp=2, dp=2, ep=4, max_seq_len=4096, batch=8)["mesh"] == p["mesh"]
    with pytest.raises(ConfigError, match="--ep 3"):
        planner.plan("v4-flash", tp=2, dp=2, ep=3)


def test_fit_decisions():
    assert not fits(planner.plan("v4-flash", tp=1, max_seq_len=4096, batch=1), "H200")
    p = planner.plan("v4-flash", tp=2, max_seq_len=65536, batch=4)
    assert fits(p, "H200") and fits(p, "B200") and fits(p, "B300")
    assert p["per_device_total"] == (p["weights"]["per_device_total"] + p["state"]["per_device_total"]
                                     + p["workspace"]["per_device"])
    h200 = next(g for g in p["gpus"] if g["gpu"] == "H200")
    assert h200["budget_bytes"] == int(0.75 * planner.GPUS["H200"][0])
    # a large prefill chunk: XLA's ragged_dot operand alone outgrows the device
    assert not fits(planner.plan("v4-flash", tp=2, max_seq_len=4096, batch=64), "H200")


def test_mem_fraction_env_is_honoured(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    p = planner.plan("v4-flash", tp=2, max_seq_len=65536, batch=4)
    assert p["memory_policy"]["mem_fraction"] == 0.5
    assert not fits(p, "H200")  # ~93 GB per device against a 75 GB budget
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "lots")
    with pytest.raises(ConfigError, match="MEM_FRACTION"):
        planner.plan("v4-flash", tp=2)


def test_nothing_is_allocated():
    before = len(jax.live_arrays())
    planner.plan("v4-flash", tp=1, max_seq_len=1 << 20, batch=64)
    assert len(jax.live_arrays()) == before


def test_v41_flash_plan():
    """V4.1 (spec §1, §4.2, §5.3): 551.88B backbone + 14.23B DSpark + 196.61B Engram tables + 0.49B vision; the KV sources'
    caches as allocated — compact rows, the paper's 890 B/token (288-B main + 68-B index rows per entry; fp32
    values under the transformers preset); Engram tables split over the devices, so 8 H200s and 4 B300s fit and
    4 H200s do not."""
    p = planner.plan("v4.1-flash", tp=8, max_seq_len=4096, batch=8)
    lp = p["weights"]["logical_params"]
    assert round(lp["backbone"] / 1e9, 2) == 551.88
    assert round(lp["mtp"] / 1e9, 2) == 14.23 and round(lp["engram"] / 1e9, 2) == 196.61
    assert round(lp["vision"] / 1e9, 3) == 0.485 and round(lp["total"] / 1e9, 1) == 763.2
    kv = p["kv_layout"]
    assert kv["global_bytes_per_token"] == kv["paper_bytes_per_token"] == 890
    assert kv["engines_bytes_per_token"] == 1630                 # spec §4.2: what SGLang / vLLM keep
    assert "engines today (SGLang, vLLM: 584-B fp8_ds_mla main + 68-B index rows): 1630 B/token — dsjax keeps 55%" \
        in planner.format_plan(p)
    assert kv["bytes_per_token"]["csa2 source (ratio 2)"] == {"layers": 3, "main": 144, "index": 34}
    assert kv["window_bytes_per_sequence"] == 40 * 128 * 528
    fp32 = planner.kv_layout(preset("v4.1-flash").with_numerics("transformers"))
    assert fp32["global_bytes_per_token"] == 3 * (2048 + 512) / 2 + 2048 + 512
    per = p["weights"]["per_device"]
    assert per["Engram tables"] == sum(-(-r // 8) * (256 + 8) for r in (384006168, 384016682))
    assert per["DSpark"] > 0 and per["Engram projections"] > 0 and "MTP" not in {k for k, v in per.items() if v}
    a, b = (planner.state_plan(preset("v4.1-flash"), 1, n)["per_device"] for n in (8192, 16384))
    assert (sum(b.values()) - sum(a.values())) / 8192 == 890
    assert fits(p, "H200") and fits(planner.plan("v4.1-flash", tp=4), "B300")
    assert not fits(planner.plan("v4.1-flash", tp=4), "H200")
    assert cli.main(["plan", "--model", "v4.1-flash", "--tp", "8"]) == 0


def test_cli_table_and_json(capsys):
    assert cli.main(["plan", "--model", "v4-flash", "--tp", "2", "--max-seq-len", "65536", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "routed experts" in out and "3514.25 B/token" in out and "H200" in out and "fits" in out
    assert cli.main(["plan", "--tp", "2", "--max-seq-len", "65536", "--batch", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mesh"]["tp"] == 2 and result["kv_layout"]["global_bytes_per_token"] == 3514.25
    assert {g["gpu"] for g in result["gpus"]} == {"H200", "B200", "B300"}


def test_bundled_checkpoint_by_name(capsys):
    """`--model` takes what `dsjax.load` takes: the bundled dsjax-small by name plans as its own config.json."""
    from dsjax.assets import bundled_path
    from dsjax.config import load_config
    assert cli.main(["plan", "--model", "dsjax-small", "--max-seq-len", "4096", "--batch", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "dsjax-small"
    want = planner.plan(load_config(bundled_path("dsjax-small")), max_seq_len=4096, batch=1)
    assert result["kv_layout"] == json.loads(json.dumps(want["kv_layout"]))


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "cannot be split 3 ways"),
    (["--tp", "32"], "1, 2, 4, 8, 16"),     # the shared expert's 16 FP8 scale blocks cap tp at 16
    (["--tp", "2", "--ep", "5"], "--ep 5"),
    (["--max-seq-len", "1"], "max_seq_len"),
])
def test_cli_bad_arguments_exit_2_without_traceback(capsys, argv, message):
    assert cli.main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--tp", "--dp", "--ep", "--max-seq-len", "--batch", "--numerics", "--mem-fraction",
                 "--json", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        assert flag in out, flag


def test_subprocess_bad_tp_is_an_error_line():
    proc = subprocess.run([sys.executable, "-m", "dsjax.cli", "plan", "--model", "v4-flash", "--tp", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
