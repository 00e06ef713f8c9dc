"""Benchmark plumbing on CPU (no timings are asserted: benchmarks are scripts, never timed tests): the roofline's
byte and FLOP accounting against the spec's worked numbers, the forced-acceptance pattern, the generation-loop rig,
`dsjax bench repro` end to end on a tiny slice, and the ablation tables and plots from a report."""

import json
import os

import numpy as np
import pytest

from dsjax.bench import ablate, roofline
from dsjax.bench.slices import parse_slice, slice_config
from dsjax.bench.step_loop import simulated_pattern, time_loop
from dsjax.config import preset
from dsjax.errors import ConfigError


def test_step_bytes_match_the_worked_example():
    # specdec-and-perf.md §3.2: a V4-Flash expert is 3 x 4096 x 2048 x 4.25 bit = 13.4 MB; routed bytes per token
    # 6 x 43 x 13.4 MB = 3.45 GB; a verify of 6 tokens touches U = 34.0 experts per layer (19.5 GB routed)
    cfg = preset("v4-flash")
    one = roofline.step_bytes(cfg, batch=1, T=1, ctx=5000)
    six = roofline.step_bytes(cfg, batch=1, T=6, ctx=5000, k_draft=5)
    assert one["routed_experts"] == pytest.approx(3.45e9, rel=0.01)
    assert roofline.unique_experts(cfg, 6) == pytest.approx(34.0, abs=0.05)
    assert six["routed_experts"] == pytest.approx(19.5e9, rel=0.01)
    # the draft: 5 LM-head reads (1.06 GB each) plus the MTP block's weights
    assert six["draft"] > 5 * cfg.vocab_size * cfg.dim * 2
    assert one["draft"] == 0 and one["kv"] < six["kv"]
    # 5k context is ~3.5 KB/token of KV per sequence (§3.2: "~18 MB"), read in full only by HCA / the indexer
    assert 5e6 < one["kv"] < 30e6


def test_flops_per_token_match_the_spec_estimates():
    # §6.2: short prompts ~26 GFLOP/token, a 1M prompt ~80 GFLOP/token on average
    cfg = preset("v4-flash")
    assert 24e9 < roofline.flops_per_token(cfg, 4096) < 32e9
    assert 70e9 < roofline.flops_per_token(cfg, 2 ** 19) < 95e9
    # V4.1-Flash: ~13B active weights (26 GFLOP) + attention over window + top-512 picks at every compressed layer
    # + the indexer at its 8 scoring layers; the Engram tables are lookups (a 2^24-row slice table would add 8.6)
    v41 = preset("v4.1-flash")
    assert 28e9 < roofline.flops_per_token(v41, 4096) < 40e9
    assert roofline.flops_per_token(v41, 2 ** 19) < 2 * roofline.flops_per_token(v41, 4096)
    assert roofline.flops_per_token(slice_config(5, 384, family="v4.1-flash"), 4096) < 7e9


def test_floor_adds_all_reduces_only_with_tensor_parallelism():
    assert roofline.floor_ms(4.3e9, 4300.0) == pytest.approx(1.0)
    assert roofline.floor_ms(8.6e9, 4300.0, tp=2, all_reduces=100) == pytest.approx(1.0 + 0.5)
    assert roofline.floor_ms(1e9, None) is None


@pytest.mark.parametrize("k", [1, 2, 5])
def test_simulated_pattern_has_the_requested_mean(k):
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 31))
    print("seed", seed)
    for al in np.random.default_rng(seed).uniform(1.0, k + 1.0, 20):
        pat = simulated_pattern(float(al), k)
        assert all(0 <= a <= k for a in pat)
        assert abs(np.mean(pat) + 1 - al) <= 0.05 + 1e-9, (al, pat)


def test_slice_specs_and_configs():
    assert parse_slice("slice:v4-flash") == ("v4-flash", 8, 256)
    assert parse_slice("slice:v4-flash:6:64") == ("v4-flash", 6, 64)
    cfg = slice_config(6, 64, pattern="model")
    full = preset("v4-flash")
    assert cfg.compress_ratios == full.compress_ratios[:6] + (0,)   # the model's own first layers + the MTP's
    assert cfg.n_hash_layers == 3 and cfg.n_routed_experts == 64 and cfg.dim == full.dim
    assert slice_config(3).compress_ratios[:3] == (0, 4, 128)
    for bad in ("slice:v4-flash:x", "slice", "slice:v4-flash:99", "slice:nope:2"):
        with pytest.raises(ConfigError):
            slice_config(*parse_slice(bad)[1:], family=parse_slice(bad)[0])


@pytest.fixture(scope="module")
def tiny_slice():
    """Its tests share an xdist_group: one worker draws the weights (32 compiled programs)."""
    from dsjax.bench.slices import slice_model
    return slice_model("slice:tiny-v4:2", max_seq_len=512)


tiny_slice_group = pytest.mark.xdist_group("bench_tiny_slice")


@tiny_slice_group
def test_loop_rig_commits_the_forced_acceptance(tiny_slice):
    r = time_loop(tiny_slice, batch=2, ctx=40, k=1, acceptance_length=2.0, steps=4, steps_per_dispatch=2)
    assert r["steps"] == 4 and r["acceptance"] == "simulated"
    assert r["tokens_per_step_per_row"] == 2.0      # every draft forced in: k + 1 tokens per step per row
    assert r["ms_per_step"] > 0


@tiny_slice_group
def test_repro_writes_the_report(tmp_path, tiny_slice):
    from dsjax.bench import repro
    from dsjax.cli import build_parser

    out = tmp_path / "repro.json"
    args = build_parser().parse_args(["bench", "repro", "--model", "slice:tiny-v4:2", "--speculative", "none",
                                      "--runs", "1", "--max-new-tokens", "6", "--extrapolate-from", "0",
                                      "--out", str(out)])
    assert repro.run(args, model=tiny_slice) == 0
    rep = json.loads(out.read_text())
    assert rep["output_tokens"] == [6] and len(rep["runs"]) == 2 and rep["runs"][0]["warmup"]
    assert rep["prompt_ids"][:1] == [0] and len(rep["prompt_sha256"]) == 64
    assert "first to the last" in rep["tokens_per_s_definition"]
    assert rep["command"].strip() and rep["machine"].startswith("cpu")   # this process's command line
    assert rep["chat"] == {"thinking": False, "family": "v4"}


def test_ablation_tables_and_plots(tmp_path):
    info = {"benchmark": "ablate", "command": "dsjax bench ablate --sweeps k", "machine": "NVIDIA H200 x1",
            "jax": "0.11.2", "date": "2026-11-30", "model": "slice:v4-flash:4", "config": "v4-flash-slice4x256",
            "roofline": {"copy_GBps": 4300.0}, "baseline": {}, "sweep": "k", "axis": "k",
            "points": [{"k": k, "ms_per_step": 3.0 + k, "floor_ms": 0.5 + k / 4, "fraction_of_floor": 0.2,
                        "tokens_per_s": 100.0, "first_dispatch_s": 20.0} for k in (0, 1, 3, 5)]}
    (tmp_path / "ablate-k.json").write_text(json.dumps(info))
    md = ablate.write_tables_and_plots(str(tmp_path))
    text = open(md).read()
    assert "| 5 | 8.00 | 1.75 | 20% |" in text and "dsjax bench ablate --sweeps k" in text
    assert os.path.getsize(tmp_path / "ablate-k.png") > 1000


def test_collective_ops_read_partitioned_hlo():
    from dsjax.bench.collectives import _bytes, collective_ops

    hlo = "\n".join([
        '  %ar = f32[8,4096]{1,0} all-reduce(f32[8,4096]{1,0} %x), replica_groups={{0,1}}, to_apply=%add',
        '  %t = (f32[64]{0}, bf16[2,3]{1,0}) all-reduce-start(f32[64]{0} %a, bf16[2,3]{1,0} %b), to_apply=%add',
        '  %ag = bf16[4,129280]{1,0} all-gather(bf16[4,64640]{1,0} %l), dimensions={1}',
        '  %m = f32[8,4096]{1,0} multiply(f32[8,4096]{1,0} %ar, f32[8,4096]{1,0} %ar)',
        '  %s = f32[]{} all-reduce(f32[]{} %c), to_apply=%add'])
    ops = collective_ops(hlo)
    assert ops == [("all-reduce", (("f32", (8, 4096)),)), ("all-reduce", (("f32", (64,)), ("bf16", (2, 3)))),
                   ("all-gather", (("bf16", (4, 129280)),)), ("all-reduce", (("f32", ()),))]
    assert _bytes(ops[1][1]) == 64 * 4 + 6 * 2


def test_tp_all_reduce_accounting_on_two_devices():
    """On two CPU devices (a subprocess): the all-reduces of a compiled row-parallel matmul are found in its HLO
    and each is timed on the mesh (count and shape asserted; the timings only checked to be positive)."""
    import subprocess
    import sys

    code = """
import json, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from dsjax import sharding
from dsjax.bench.collectives import collective_ops, time_all_reduces
mesh = sharding.make_mesh(2, 1)
x = jax.device_put(jnp.ones((4, 256), jnp.float32), NamedSharding(mesh, P(None, "tp")))
w = jax.device_put(jnp.ones((256, 128), jnp.float32), NamedSharding(mesh, P("tp", None)))
f = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P()))
ops = collective_ops(f.lower(x, w).compile().as_text())
print(json.dumps(time_all_reduces(ops, mesh, n_short=2, n_long=12)))
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(r)
    assert r["all_reduces"] == 1 and r["by_shape"][0]["arrays"] == ["f32[4, 128]"]
    assert r["by_shape"][0]["count"] == 1 and r["all_reduce_ms_per_step"] >= 0.0


def test_tp_comparison_against_the_first_degree():
    from dsjax.bench.tp import _public, compare

    def run(tp, ms, prefill_s, logits, tokens):
        return {"tp": tp, "prefill_s": prefill_s, "last_logits": np.asarray(logits, np.float32),
                "decode": {"ms_per_step": ms, "tokens": tokens}, "verify": {"ms_per_step": 2 * ms}}

    runs = [run(1, 4.0, 1.0, [1.0, 3.0, 2.0], [[5, 6, 7, 8], [1, 2, 3, 4]]),
            run(2, 2.5, 0.6, [1.0, 2.5, 2.75], [[5, 6, 9, 8], [1, 2, 3, 4]])]
    compare(runs)
    two = runs[1]
    assert two["decode"]["speedup_vs_first"] == pytest.approx(1.6)
    assert two["decode"]["scaling_efficiency"] == pytest.approx(0.8)
    assert two["verify"]["scaling_efficiency"] == pytest.approx(0.8)
    assert two["prefill_scaling_efficiency"] == pytest.approx(1.0 / 0.6 / 2)
    assert two["logits"] == {"max_abs_diff_vs_first": 0.75, "scale": 3.0, "argmax_equal": False}
    assert two["decode"]["greedy_equal_prefix"] == 2 and two["decode"]["greedy_compared"] == 4
    assert "last_logits" not in _public(runs)[1] and "tokens" not in _public(runs)[1]["decode"]


def test_tp_slice_family_splits_eight_ways():
    from dsjax import sharding
    from dsjax.bench.slices import full_config, parse_slice

    cfg = slice_config(*parse_slice("slice:tiny-v4-tp:3")[1:], family="tiny-v4-tp", pattern="model")
    assert full_config(cfg).n_heads == 8 and cfg.n_layers == 3
    from jax.sharding import AbstractMesh
    mesh = AbstractMesh((1, 8), sharding.MESH_AXES)
    sharding.param_shardings(cfg, mesh)   # raises ConfigError where a split does not divide


def test_v41_slices_keep_valid_csa2_roles_and_read_engram_rows_not_tables():
    """The V4.1 slice remaps the representative layers' CSA2 roles (validated by the config itself), DSpark reads
    its last three layers, and the step's floor counts the Engram rows a token reads, not the table."""
    from dsjax.bench.slices import full_config

    cfg = slice_config(*parse_slice("slice:v4.1-flash")[1:], family="v4.1-flash")
    assert cfg.n_layers == 8 and cfg.n_routed_experts == 384 and cfg.dim == 5120 and cfg.vision_n_layers == 0
    assert cfg.compress_ratios[:8] == (0, 0, 2, 2, 2, 1, 1, 1)
    assert cfg.kv_source_layers == (2, 4, 5) and cfg.index_source_layers == (2, 4, 5, 7)
    assert cfg.candidate_source_layer == 5 and cfg.engram_layer_ids == (1,) and cfg.dspark_target_layer_ids == (5, 6, 7)
    assert full_config(cfg).n_layers == 40
    b = roofline.step_bytes(cfg, batch=1, T=1, ctx=4096)
    table = cfg.engram_num_embeddings[0] * cfg.engram_head_dim * (1 + 1 / 32)   # fp8 codes + one e8m0 per 32
    assert b["dense_weights"] < table                     # the 4.3 GB table is not read whole
    from dsjax.layers.engram import engram_constants     # the cut table's hash stays in range of its rows
    c = engram_constants(cfg)
    assert abs(cfg.engram_num_embeddings[0] - (1 << 24)) < 1 << 14    # primes a little above the cut base
    assert int(c.offsets[0, -1] + c.primes[0, -1, -1]) == cfg.engram_num_embeddings[0]
    for bad in ("slice:v4.1-flash:2", "slice:v4.1-flash:9", "slice:v4.1-flash:8:3"):
        with pytest.raises(ConfigError):
            slice_config(*parse_slice(bad)[1:], family="v4.1-flash")


def test_full_depth_extrapolates_v41_per_layer_kind_and_the_1m_fit_stays_nonnegative():
    """V4: linear in layers. V4.1 (slice: 5 encoder + 3 decoder layers; full: 20 + 20): three depths separate
    the encoder layer from fixed costs; two (prefill) scale them together (an upper bound). The 1M fit never
    turns a growing cost negative."""
    from dsjax.bench.prefill import nonnegative_fit
    from dsjax.bench.slices import full_depth, proxy_depths

    v41 = slice_config(*parse_slice("slice:v4.1-flash")[1:], family="v4.1-flash")
    assert proxy_depths(v41, 6) == [3, 5, 8]
    fixed, enc, dec = 4.0, 1.0, 2.0          # t(L) = fixed + L_enc * enc + L_dec * dec
    t = {3: fixed + 3 * enc, 5: fixed + 5 * enc, 8: fixed + 5 * enc + 3 * dec}
    fit = full_depth(v41, t)
    assert fit["full"] == pytest.approx(fixed + 20 * enc + 20 * dec)
    assert fit["per_layer"] == pytest.approx({"encoder": enc, "decoder": dec})
    two = full_depth(v41, {5: 5.0, 8: 11.0})
    assert two["full"] == pytest.approx(20 * 1.0 + 20 * 2.0) and "upper bound" in two["method"]
    v4 = slice_config(4, 16, family="v4-flash", pattern="model")
    assert proxy_depths(v4, 2) == [2, 4]
    assert full_depth(v4, {2: 2.0, 4: 4.0})["full"] == pytest.approx(4.0 + 39 * 1.0)
    S = np.array([8192.0, 16384, 32768])
    a, b = nonnegative_fit(np.stack([S, S * S], 1), 2e-5 * S + 1e-11 * S * S)
    assert a == pytest.approx(2e-5) and b == pytest.approx(1e-11)
    a, b = nonnegative_fit(np.stack([S, S * S], 1), np.array([1.0, 2.1, 3.9]))   # concave noise: b would be < 0
    assert b == 0.0 and a == pytest.approx(np.dot(S, [1.0, 2.1, 3.9]) / np.dot(S, S))


@pytest.fixture(scope="module")
def v41_slice():
    """tiny-v41's first 5 representative layers: window, window + Engram, ratio-2 source and Reuse (encoder),
    the ratio-1 source (decoder). Its tests share an xdist_group: one worker draws the weights (40 programs)."""
    from dsjax.bench.slices import slice_model
    return slice_model("slice:tiny-v41:5", max_seq_len=256)


v41_slice_group = pytest.mark.xdist_group("bench_v41_slice")


@v41_slice_group
def test_prefill_schedules_run_on_a_v41_slice(v41_slice):
    """`bench prefill --schedule replay` times the CED replay (encoder chunks, then the decoder over the last
    window) of one ragged prompt; V4 refuses the replay; a V4.1 proxy depth lies within the encoder layers."""
    from dsjax.bench.prefill import prefill_seconds
    from dsjax.bench.slices import shallower

    model = v41_slice
    secs, first = prefill_seconds(model, 40, 32, schedule="replay")
    assert 0 < secs and 0 < first
    with pytest.raises(ConfigError, match="encoder layers"):
        shallower(model, 5)
    assert shallower(model, 4).cfg.n_layers == 4 and shallower(model, 3).cfg.n_layers == 3
    from dsjax.bench.prefill import schedule_steps
    with pytest.raises(ConfigError, match="exact schedule only"):
        schedule_steps(slice_config(2, 8, family="tiny-v4", pattern="model"), "replay", 40)


@v41_slice_group
def test_loop_rig_times_dspark_on_a_v41_slice(v41_slice):
    """V4.1 slices draft with DSpark in the timed loop (`bench tp`, `ablate`, `repro`'s extrapolation): forced
    acceptance commits k + 1 tokens a step; the floor counts DSpark's stages and head."""
    model = v41_slice
    r = time_loop(model, batch=1, ctx=40, k=2, steps=2, steps_per_dispatch=1)
    assert r["steps"] == 2 and r["acceptance"] == "simulated" and r["tokens_per_step_per_row"] == 3.0
    b0 = roofline.step_bytes(model.cfg, batch=1, T=3, ctx=40)
    b2 = roofline.step_bytes(model.cfg, batch=1, T=3, ctx=40, k_draft=2)
    assert b2["draft"] > roofline._bytes(roofline.describe(model.cfg).head) and b0["draft"] == 0


def test_step_acceptance_lengths_from_prefix_counts():
    """The H200 run of dsjax-small (651 steps, 2,349 drafts accepted at positions 573/516/459/432/369): the
    per-step lengths add up to the committed tokens, their median is read off the counts; a count that is not a
    prefix count is refused."""
    from dsjax.bench.repro import step_acceptance_lengths

    lengths = step_acceptance_lengths([573, 516, 459, 432, 369], 651)
    assert lengths.size == 651 and lengths.sum() == 651 + 2349
    assert (lengths == 6).sum() == 369 and (lengths == 1).sum() == 651 - 573
    assert float(np.percentile(lengths, 50)) == 6.0 and lengths.min() == 1
    with pytest.raises(ValueError, match="prefix"):
        step_acceptance_lengths([3, 5], 10)


def test_repro_says_when_the_checkpoint_is_too_short():
    from dsjax.bench import repro
    from dsjax.cli import build_parser
    from dsjax.errors import ConfigError

    args = build_parser().parse_args(["bench", "repro", "--model", "dsjax-small", "--max-new-tokens", "5142"])
    with pytest.raises(ConfigError, match=r"more than dsjax-small holds \(4096\); pass a smaller --max-new-tokens"):
        repro.run(args)


def test_prefill_plot_and_merged_projection(tmp_path):
    """Two runs' rows merge by prompt length and the 1M fit is redone through all full-model points: with exact
    t = 1e-4·S + 1e-9·S² the fit returns those coefficients; the PNG is written."""
    from dsjax.bench import prefill_plot

    def report(lengths):
        rows = [{"tokens": n, "slice4": {"s": 1e-5 * n, "tokens_per_s": 1e5},
                 "full_extrapolated": {"s": 1e-4 * n + 1e-9 * n * n, "tokens_per_s": n / (1e-4 * n + 1e-9 * n * n)}}
                for n in lengths]
        return {"config": "v4-flash-slice4x256", "machine": "cpu x1", "date": "2026-12-01", "rows": rows,
                "one_million": None, "rival": {"engine": "rival", "one_million_s": 11.7}}

    merged = prefill_plot.merge([report([8192, 65536]), report([131072])])
    assert [r["tokens"] for r in merged["rows"]] == [8192, 65536, 131072]
    fit = merged["one_million"]["exact"]["fit"]
    assert fit["a_s_per_token"] == pytest.approx(1e-4, rel=1e-6) and fit["b_s_per_token2"] == pytest.approx(1e-9, rel=1e-6)
    path = prefill_plot.plot_prefill(merged, str(tmp_path / "p.png"))
    assert path and os.path.getsize(path) > 10_000


def test_kernels_bench_times_the_linear_kernel_inside_one_dispatch(tmp_path):
    """`bench kernels --ops linear --smoke`: the stored-format kernel (HLO interpreter here) beside XLA, timed per
    call inside one jitted loop (a projection is shorter than a dispatch), with its output equal to XLA's."""
    from dsjax.bench import kernels

    out = tmp_path / "k.jsonl"
    assert kernels.main(["--ops", "linear", "--smoke", "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert {(r["impl"], r["tokens"]) for r in recs} == {(i, n) for i in ("xla", "pallas") for n in (1, 8)}, recs
    assert all(r["timing"] == "device loop" and r["us"] > 0 and "error" not in r for r in recs), recs
    # both round an fp32 sum to bf16: summation order may flip one rounding, ≤ one bf16 ulp (2^-7 relative)
    assert all(r["rel_diff_vs_xla"] <= 2.0 ** -7 for r in recs if r["impl"] == "pallas"), recs


def test_kernels_bench_times_extra_moe_configs(tmp_path, capsys):
    """`bench kernels --moe-configs`: each extra option set is timed beside the defaults, its output compared with
    the default's (same numbers within fp32 summation order); a bad list is refused with a message, exit 2."""
    from dsjax.bench import kernels

    out = tmp_path / "k.jsonl"
    extra = '[{"block_m": 2, "block_k": 128}]'
    assert kernels.main(["--ops", "moe", "--smoke", "--moe-formats", "bf16", "--moe-tokens", "1",
                         "--moe-configs", extra, "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()][1:]
    mine = [r for r in recs if r.get("options") == {"block_m": 2, "block_k": 128}]
    assert len(mine) == 1 and "error" not in mine[0] and mine[0]["us"] > 0, recs
    assert mine[0]["rel_diff_vs_first_config"] <= 2.0 ** -7, mine
    assert {r.get("activations") for r in recs if r.get("op") == "moe_gemm"} == {"fp8"}
    out_bf16 = tmp_path / "b.jsonl"                     # bf16 activations: the reference-bf16 numerics' kernels
    assert kernels.main(["--ops", "moe", "--smoke", "--moe-formats", "bf16", "--moe-tokens", "1",
                         "--moe-activations", "bf16", "--out", str(out_bf16)]) == 0
    recs = [json.loads(line) for line in out_bf16.read_text().splitlines()][1:]
    assert recs and all(r["activations"] == "bf16" and "error" not in r for r in recs if r.get("op") == "moe_gemm")
    for bad, says in (('{"block_m": 2}', "list of objects"), ('[{"block_q": 2}]', "block_q"), ("[{", "not JSON")):
        with pytest.raises(SystemExit) as exc:
            kernels.main(["--ops", "moe", "--smoke", "--moe-configs", bad])
        assert exc.value.code == 2 and says in capsys.readouterr().err
    for bad, says in (("x", "comma-separated integers"), ("0,2", "positive")):    # any positive count is timed
        with pytest.raises(SystemExit) as exc:
            kernels.main(["--ops", "moe", "--smoke", "--moe-tokens", bad])
        assert exc.value.code == 2 and says in capsys.readouterr().err


def test_moe_profile_lists_the_calls_kernels(tmp_path, capsys):
    """`bench moe_profile`: one traced configuration's kernels by time (the routing sort among them), their sum the
    call's total; bad token counts and option lists are refused with exit 2."""
    from dsjax.bench import moe_profile

    out = tmp_path / "p.json"
    assert moe_profile.main(["--smoke", "--tokens", "2", "--reps", "1", "--implementation", "xla",
                             "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (prof,) = report["profiles"]
    assert prof["tokens"] == 2 and len(prof["kernels"]) > 1
    assert prof["us_per_call"] == pytest.approx(sum(prof["kernels"].values())) and prof["us_per_call"] > 0
    assert any("sort" in name for name in prof["kernels"]), prof["kernels"]
    assert "µs a call" in capsys.readouterr().out
    for bad, says in ((["--tokens", "x"], "--tokens"), (["--tokens", "0"], "positive"),
                      (["--configs", '[{"block_q": 1}]'], "block_q")):
        with pytest.raises(SystemExit) as exc:
            moe_profile.main(["--smoke", *bad])
        assert exc.value.code == 2 and says in capsys.readouterr().err


def test_looped_timer_keeps_every_output():
    """`time_us_looped` times every kernel of a call: each output feeds the next call, so XLA cannot drop one as
    dead code (the read ceiling's two-launch row once timed its first launch alone)."""
    import jax.numpy as jnp

    from dsjax.bench.kernels import looped_calls

    x = jnp.arange(8, dtype=jnp.float32)
    hlo = looped_calls(lambda a: (jnp.sin(a), jnp.cos(a) * 3.0), 4).lower(x).compile().as_text()
    assert "sine" in hlo and "cosine" in hlo


def test_timed_calls_hoist_nothing():
    """Work that depends only on a call's other small inputs (the MoE op's routing: its weights and ids) stays in
    every call: XLA's loop-invariant code motion moved it out of the timed loop while only the first input was
    linked (seen in the compiled HLO on the CPU, 2026-12-06)."""
    import jax.numpy as jnp

    from dsjax.bench.kernels import looped_calls

    x = jnp.arange(8, dtype=jnp.float32)
    w, ids = jnp.linspace(0.0, 1.0, 8), jnp.arange(8, dtype=jnp.int32)
    fn = lambda a, w, ids: a * jnp.sum(jnp.sin(w) * jnp.cos(ids.astype(jnp.float32)))  # noqa: E731
    looped = looped_calls(fn, 4).lower(x, w, ids).compile().as_text()
    blocks = [b for b in looped.split("\n\n") if "{" in b]      # the compiled program's computations
    name = lambda b: b.split("(")[0].split()[-1].lstrip("%")  # noqa: E731
    callers = lambda c: [b for b in blocks if f"calls=%{c}" in b or f"to_apply=%{c}" in b]  # noqa: E731
    holders = [b for b in blocks if " sine(" in b or " cosine(" in b]
    assert holders
    for b in holders:                                   # no computation of them runs from the entry, before the loop
        assert not b.lstrip().startswith("ENTRY") and not any(c.lstrip().startswith("ENTRY") for c in callers(name(b)))


def test_moe_read_ceiling_reads_every_word(tmp_path, capsys):
    """`bench moe_read_ceiling`: the loads-only kernels (interpreted) XOR exactly the words of their experts' rows,
    K split included, from the weights in `tile_major` layout too (the same words a step), an unused tile reads
    nothing; the persistent launch too, with a program past the end (15
    programs of 8 steps over 112: the last has none), folding the FP4 decode's words in step order, and both
    projections' reads in one persistent launch (each group as its own persistent launch folds it); each part is
    timed; an option set the kernel refuses is reported and the run goes on; unknown options are refused with exit
    2. Then the CUDA lowering at V4-Flash's shapes (the same grid and pipeline as the GEMM kernels; the persistent
    launch, one program an SM; and the one-launch read of both projections)."""
    import jax
    import jax.numpy as jnp

    from dsjax.bench import moe_read_ceiling
    from lower_h200 import lower_for_h200

    out = tmp_path / "r.jsonl"
    configs = '[{"k_splits": 2, "tiled": true}, {"k_splits": 3}, {"programs": 15, "decode": true}]'
    assert moe_read_ceiling.main(["--smoke", "--tokens", "1", "--configs", configs, "--out", str(out)]) == 0
    head, *recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert head["shapes"]["k"] == 6
    timed = [r for r in recs if "us" in r]
    assert {r["part"] for r in timed} == {"up", "down", "both", "one launch"} and all(r["us"] > 0 for r in timed)
    assert {r["options"].get("programs") for r in timed if r["part"] == "one launch"} == {15}
    assert timed[0]["bytes"] == 6 * 2 * 512 * 512 // 2
    assert {r["options"].get("programs") for r in timed} == {None, 15}
    assert {r["options"].get("tiled") for r in timed} == {True, None}
    (refused,) = [r for r in recs if "error" in r]
    assert refused["options"] == {"k_splits": 3} and "whole steps" in refused["error"]
    with pytest.raises(SystemExit) as exc:
        moe_read_ceiling.main(["--smoke", "--configs", '[{"pairs": 8}]'])
    assert exc.value.code == 2 and "pairs" in capsys.readouterr().err
    S = jax.ShapeDtypeStruct
    text = lower_for_h200(lambda g, u, x: moe_read_ceiling.read_words([g, u], x, interpret=False),
                          S((256, 2048, 512), jnp.uint32), S((256, 2048, 512), jnp.uint32), S((6,), jnp.int32))
    assert "mosaic_gpu" in text
    text = lower_for_h200(lambda d, x: moe_read_ceiling.read_words([d], x, programs=132, stages=4, decode=True,
                                                                             interpret=False),
                          S((256, 4096, 256), jnp.uint32), S((6,), jnp.int32))
    assert "mosaic_gpu" in text
    text = lower_for_h200(lambda g, u, d, x: moe_read_ceiling.read_words_one_launch([[g, u], [d]], x, programs=132,
                                                                                   stages=4, interpret=False),
                          S((256, 2048, 512), jnp.uint32), S((256, 2048, 512), jnp.uint32),
                          S((256, 4096, 256), jnp.uint32), S((6,), jnp.int32))
    assert "mosaic_gpu" in text


def test_moe_profile_names_each_kernels_source_line(tmp_path):
    """`moe_profile --dump`: in a fresh process (XLA reads the dump flag at start-up), every kernel gets a source
    entry, and the expert matmuls' kernels point at the MoE op's own files."""
    import subprocess
    import sys

    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "dsjax.bench.moe_profile", "--smoke", "--tokens", "2", "--reps", "1",
                           "--implementation", "xla", "--dump", str(tmp_path / "dump"), "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (prof,) = json.loads(out.read_text())["profiles"]
    assert set(prof["sources"]) == set(prof["kernels"])
    top = max(prof["kernels"], key=prof["kernels"].get)
    assert "moe_gemm/" in prof["sources"][top], (top, prof["sources"])


def test_kernels_bench_times_the_lm_head_both_ways(tmp_path, capsys):
    """`bench kernels --ops head`: `lm_head`'s fp32 dot and its exact bf16 split, both timed, their logits equal up
    to fp32 summation order (every product is exact in both); an unknown op exits 2."""
    from dsjax.bench import kernels

    out = tmp_path / "h.jsonl"
    assert kernels.main(["--ops", "head", "--smoke", "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert sorted((r["tokens"], r["impl"]) for r in recs) == [(1, "bf16x3"), (1, "fp32-highest"), (6, "bf16x3"),
                                                              (6, "fp32-highest")]
    # 64-term fp32 sums in another order: |Δ| ≤ 64 · 2^-24 of the largest partial sum's scale, far below 1e-5
    assert all(r["us"] > 0 and r["rel_diff_vs_fp32"] <= 1e-5 for r in recs), recs
    with pytest.raises(SystemExit) as exc:
        kernels.main(["--ops", "moe,heads", "--smoke"])
    assert exc.value.code == 2 and "heads" in capsys.readouterr().err


@pytest.mark.parametrize("family,layers", [("tiny-v4", 2), ("tiny-v41", 5)])
def test_chunk_step_keeps_the_last_layer_whole(family, layers):
    """The prefill bench and profiler time a slice's chunk through `chunk_step`: its last layer keeps its attention
    and its router in the compiled program. A step that returns the state alone loses them to XLA's dead-code
    elimination (checked for V4: this is what the benches timed before), so the slice would time a layer short."""
    import re

    import jax
    import jax.numpy as jnp

    from dsjax.bench.slices import chunk_step
    from dsjax.model import forward_chunk
    from dsjax.params import init_params
    from dsjax.state import init_state
    from dsjax.v41_state import init_state41

    cfg = slice_config(layers, 8, family=family, pattern="model")
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    state = jax.eval_shape(lambda: (init_state41 if cfg.family == "v4.1" else init_state)(cfg, 1, 64))
    ids = jax.ShapeDtypeStruct((1, 16), jnp.int32)

    def last_layer_dots(f):
        txt = jax.jit(f).lower(params, ids, state).compile().as_text()
        return {n.split("/")[-2] for n in re.findall(r'op_name="([^"]*)"', txt)
                if f"/layer{layers - 1}/" in n and n.endswith("dot_general")}

    whole = last_layer_dots(chunk_step(cfg))
    assert {"nd,ed->ne", "bthk,btkd->bthd"} <= whole, whole        # the router, the attention's scores
    if family == "tiny-v4":
        state_only = last_layer_dots(lambda p, t, s: forward_chunk(p, cfg, t, s)[1])
        assert not {"nd,ed->ne", "bthk,btkd->bthd"} & state_only, state_only


def test_prefill_merge_of_the_h200_runs(tmp_path):
    """The H200 night's 128k run and its 8k/64k run (docs/benchmarks/h200-2026-12-04e/), timed in separate calls,
    merge into the three-length 1M fit the docs quote (replay ~350 s, exact ~2,000 s), labelled with where they
    ran; reports of another config or chunk are refused."""
    from dsjax.bench import prefill_plot

    d = os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks", "h200-2026-12-04e")
    a, b = (os.path.join(d, f) for f in ("call4-prefill-128k.json", "call5-prefill-8k-64k.json"))
    assert prefill_plot.main([a, b, "--out", str(tmp_path / "m.png"), "--json", str(tmp_path / "m.json")]) == 0
    merged = json.load(open(tmp_path / "m.json"))
    assert [r["tokens"] for r in merged["rows"]] == [8192, 65536, 131072]
    assert merged["machine"] == "NVIDIA H200 x1" and merged["date"] == "2026-12-04"
    assert round(merged["one_million"]["replay"]["s_one_gpu_equivalent"]) == 350
    assert round(merged["one_million"]["exact"]["s_one_gpu_equivalent"]) == 2000
    other = json.load(open(a))
    other["rows"][0]["chunk"] = 512
    with pytest.raises(ConfigError, match="different chunks"):
        prefill_plot.merge([other, json.load(open(b))])
    other = json.load(open(a))
    other["config"] = "v4-flash-slice4x256"
    with pytest.raises(ConfigError, match="config"):
        prefill_plot.merge([other, json.load(open(b))])


def test_lowered_kernels_print_the_same_code_alike_and_other_code_apart():
    """`lowered_kernels` (a kernel's code compared across edits without a GPU): the default FP4 expert op lowered
    twice in one process prints the same two Mosaic kernels once the locations and the dump counter are dropped;
    naming the default (`mosaic_wait_per_linear` True) changes nothing; `mosaic_quad_waits` changes both kernels."""
    from dsjax.bench.lowered_kernels import digest, moe_kernels

    first, again, named, quads = (moe_kernels("tiny", 2, options) for options in (
        {}, {}, {"mosaic_wait_per_linear": True}, {"mosaic_quad_waits": True}))
    assert len(first) == 2 and all("wgmma" in k and "loc(" not in k for k in first)
    assert [digest(k) for k in again] == [digest(k) for k in first] == [digest(k) for k in named]
    assert all(digest(a) != digest(b) for a, b in zip(quads, first))
