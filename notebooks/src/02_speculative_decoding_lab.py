# %% [markdown]
# # Speculative-decoding lab: acceptance, draft length, draft quality, and losslessness
#
# A speculative step drafts *k* tokens cheaply, verifies them with **one** target forward over k+1 positions,
# keeps the longest accepted prefix and adds one token of the target's own (the *bonus* token). If each draft
# is accepted with probability α, independently and given that the ones before it were, the number of tokens a
# step commits — the **acceptance length**, bonus included — has mean
#
# $$E[L] \;=\; \sum_{j=0}^{k} \alpha^j \;=\; \frac{1-\alpha^{k+1}}{1-\alpha},$$
#
# because draft *j* survives with probability α^j. This notebook checks that closed form against dsjax's
# on-device loop and its acceptance rule, and shows what it implies:
#
# 1. **acceptance vs a controlled draft quality** in the real `Model.generate(speculative="mtp")` loop, with
#    the test suite's corrupted oracle (each draft is the target's own next token with probability α);
# 2. **acceptance vs draft length k** under temperature sampling, where α is no longer a knob but the overlap
#    Σ min(p, q) of target and draft distributions — run through `dsjax.speculative.accept`;
# 3. **the distribution check**: rejection sampling must leave the target's distribution untouched, whatever
#    the draft; a chi-square test shows it does, and that the same test catches a subtly wrong rule.
#
# Random weights make the MTP head's own acceptance meaningless (design.md: "acceptance lengths from random
# weights mean nothing"), so every α here is *controlled*, and every measured mean is compared with the closed
# form within a stated bound (6 σ of the per-step spread, seeds fixed).

# %%
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from scipy import stats

import dsjax
from dsjax.params import init_params
from dsjax.sampling import SamplingParams, filtered_logprobs
from dsjax.speculative import OracleDrafts, accept


def expected_length(alpha, k):
    """E[L] = 1 + α + ... + α^k: mean tokens committed per step (bonus included)."""
    return sum(np.asarray(alpha, float) ** j for j in range(k + 1))


def six_sigma(alpha, k, steps):
    """6 σ of the mean accepted drafts over `steps` i.i.d. steps: P(a ≥ j) = α^j, E[a²] = Σ (2j-1) α^j."""
    ea = sum(alpha ** j for j in range(1, k + 1))
    var = sum((2 * j - 1) * alpha ** j for j in range(1, k + 1)) - ea ** 2
    return 6 * (max(var, 0.0) / steps) ** 0.5

# %% [markdown]
# ## 1. The real loop, with a controlled draft quality
#
# A small `tiny-v4` variant (4 layers — window, CSA, HCA, CSA — a 1,024-token vocabulary, window 8, fp32
# `"transformers"` numerics so that speculative greedy output is bit-identical to plain greedy). The drafter is
# `OracleDrafts`, the tests' controlled drafter: draft *j* of a step is the target's true next token with
# probability α (`keep`), else a different token. Everything else — verify, accept, commit, rollback of the
# rejected positions, stats — is the production loop, many steps per dispatch.
#
# The oracle needs the target's greedy continuation. We take it from the speculative loop itself with α = 0
# (drafts that are almost never right): greedy speculative decoding equals greedy decoding token for token
# (`tests/test_speculative.py`), and this way one compiled loop serves every run below, since α is an array,
# not a compile-time constant.

# %%
VOCAB, K, NEW = 1024, 3, 100
cfg = dsjax.preset("tiny-v4", vocab_size=VOCAB, n_layers=4, compress_ratios=(0, 4, 16, 4, 0), window_size=8,
                   index_topk=4).with_numerics("transformers")
model = dsjax.Model(cfg, init_params(cfg, 5), source="tiny-v4 (4 layers, random weights)", max_seq_len=128,
                    max_batch=4)
rng = np.random.default_rng(0)
prompts = [rng.integers(2, VOCAB, n).tolist() for n in (5, 8, 11, 14)]


def run(alpha, tokens):
    return model.generate(prompts, NEW, stop_token_ids=[], speculative="mtp", num_draft_tokens=K, seed=1,
                          oracle_drafts=OracleDrafts(jnp.asarray(tokens, jnp.int32), jnp.float32(alpha)))


t0 = time.perf_counter()
greedy = run(0.0, np.zeros((len(prompts), NEW + K + 1)))
print(f"compile + first run {time.perf_counter() - t0:.1f} s")
oracle = np.asarray([g.tokens + [0] * (K + 1) for g in greedy])

alphas = [0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 1.0]
measured = {}
for a in alphas:
    gens = run(a, oracle)
    assert all(g.tokens == r.tokens for g, r in zip(gens, greedy)), "a draft changed greedy output"
    steps = sum(g.stats["row_steps"] for g in gens)
    per_pos = np.sum([np.asarray(g.stats["acceptance_per_position"]) * g.stats["row_steps"] for g in gens], 0) / steps
    measured[a] = dict(steps=steps, length=1 + sum(g.stats["accepted"] for g in gens) / steps, per_pos=per_pos)
    m, e, b = measured[a]["length"], expected_length(a, K), six_sigma(a, K, steps)
    print(f"α = {a:<4}  {steps:>3} steps  mean acceptance length {m:.3f}   closed form {e:.3f} ± {b:.3f}")
    assert abs(m - e) <= b + 1e-9
print(f"all runs {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# Left: the measured mean acceptance length for each α (bars: the 6 σ bound for that many steps) on the closed
# form. Right: how often draft position *j* is accepted — the loop's `acceptance_per_position` — against α^j:
# later drafts only count if every earlier one did, which is why long drafts need a very good drafter.

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
grid = np.linspace(0, 1, 101)
ax1.plot(grid, expected_length(grid, K), "k-", lw=1, label=f"closed form, k = {K}")
ax1.errorbar(alphas, [measured[a]["length"] for a in alphas],
             yerr=[six_sigma(a, K, measured[a]["steps"]) for a in alphas], fmt="o", capsize=3,
             label="measured (real loop, 4 rows x 100 tokens)")
ax1.set_xlabel("per-draft acceptance α (controlled)")
ax1.set_ylabel("mean acceptance length")
ax1.legend(fontsize=8)
for i, a in enumerate((0.4, 0.8, 0.95)):
    ax2.plot(range(1, K + 1), a ** np.arange(1, K + 1), "-", color=f"C{i}", lw=1)
    ax2.plot(range(1, K + 1), measured[a]["per_pos"], "o", color=f"C{i}", label=f"α = {a}")
ax2.set_xticks(range(1, K + 1))
ax2.set_xlabel("draft position j")
ax2.set_ylabel("P(draft j accepted)")
ax2.set_title("measured (dots) vs α^j (lines)", fontsize=10)
ax2.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 2. Acceptance vs draft length, with sampling
#
# Under temperature sampling the target accepts draft *d* with probability min(1, p(d)/q(d)) and, on a
# rejection, samples from the residual max(p − q, 0) (Leviathan et al. 2023; Chen et al. 2023). A draft drawn
# from q is then accepted with probability α = Σ_v min(p(v), q(v)) = 1 − TV(p, q): the draft *quality* is the
# overlap of the two distributions. We control it by mixing: q_λ = λ·p + (1 − λ)·r, with r an unrelated
# distribution, so λ = 1 is a perfect drafter and λ = 0 a poor one.
#
# The experiment runs `dsjax.speculative.accept` — the rule the loop uses — over many independent simulated
# steps (one row each), with a fixed 16-token target p at every position. Draft length is swept without
# recompiling through `accept(offered=...)`, the argument adaptive verification uses: only the first
# `offered` of the 8 drafts are verified.

# %%
V, K_MAX, N = 16, 8, 4000
g = np.random.default_rng(1)
target_logits = g.normal(0, 1.5, V).astype(np.float32)
p = np.exp(target_logits.astype(np.float64)) / np.exp(target_logits.astype(np.float64)).sum()
r = np.exp(g.normal(0, 1.5, V)); r /= r.sum()


def draft_dist(lam):
    return lam * p + (1 - lam) * r


def sampling(n, seed):
    keys = jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(seed), i)))(jnp.arange(n))
    return SamplingParams(jnp.ones(n), jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.zeros(n), keys)


@jax.jit
def simulate(q, offered, seed):
    """N speculative steps with drafts from q: (accepted drafts [N], committed tokens [N, K_MAX+1])."""
    sp = sampling(N, seed)
    logits = jnp.broadcast_to(jnp.asarray(target_logits), (N, K_MAX + 1, V))
    logq = jnp.broadcast_to(jnp.log(q), (N, K_MAX, V))
    drafts = jax.random.categorical(jax.random.PRNGKey(seed + 7), logq).astype(jnp.int32)
    return accept(logits, drafts, logq, sp, jnp.zeros(N, jnp.int32), None, 0,
                  offered=jnp.full(N, offered, jnp.int32))


# the rule samples from the target's filtered distribution: with temperature 1 and no filter, that is p itself
assert np.allclose(np.exp(np.asarray(filtered_logprobs(jnp.asarray(target_logits)[None], sampling(1, 0))))[0], p,
                   atol=1e-6)

lams = (0.0, 0.5, 0.8, 0.95)
ks = range(1, K_MAX + 1)
sweep = {}
for lam in lams:
    q = draft_dist(lam)
    alpha = float(np.minimum(p, q).sum())
    for k in ks:
        a, _ = simulate(jnp.asarray(q, jnp.float32), k, 1000 * k + int(100 * lam))
        sweep[lam, k] = (1 + float(np.mean(np.asarray(a))), expected_length(alpha, k), six_sigma(alpha, k, N))
        m, e, b = sweep[lam, k]
        assert abs(m - e) <= b, (lam, k, m, e, b)
    print(f"λ = {lam:<4}: α = Σ min(p, q) = {alpha:.3f};  measured / closed form at k = 1, 4, 8: "
          + ", ".join(f"{sweep[lam, k][0]:.2f} / {sweep[lam, k][1]:.2f}" for k in (1, 4, 8)))

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
for i, lam in enumerate(lams):
    alpha = float(np.minimum(p, draft_dist(lam)).sum())
    ax1.plot(ks, [sweep[lam, k][1] for k in ks], "-", color=f"C{i}", lw=1)
    ax1.errorbar(ks, [sweep[lam, k][0] for k in ks], yerr=[sweep[lam, k][2] for k in ks], fmt="o", ms=4,
                 color=f"C{i}", capsize=2, label=f"λ = {lam} (α = {alpha:.2f})")
    ax2.plot(ks, [sweep[lam, k][0] / (k + 1) for k in ks], "o-", color=f"C{i}", ms=4)
ax1.plot(ks, [k + 1 for k in ks], "k:", lw=1, label="every draft accepted")
ax1.set_xlabel("draft length k")
ax1.set_ylabel("mean acceptance length")
ax1.set_title("measured (dots, 6σ bars) vs closed form (lines)", fontsize=10)
ax1.legend(fontsize=8)
ax2.set_xlabel("draft length k")
ax2.set_ylabel("committed tokens / verified positions")
ax2.set_title("share of the verify forward that commits", fontsize=10)
ax2.set_ylim(0, 1.05)
fig.tight_layout()
plt.show()

# %% [markdown]
# The acceptance length saturates at 1/(1 − α) as k grows, while the verify forward keeps growing with k + 1
# (right: the share of verified positions that end up committed). Whether a longer draft pays depends on how
# the step time grows with k — what the `k` sweep of `dsjax bench ablate` measures (step-time ablations
# notebook). Turned around, a reported acceptance length says what α a drafter reached: the 5.6 tokens per step
# that the Rust+CUDA engine dsjax measures itself against reports for V4.1-Flash (DSpark, 5 drafts) need
# α ≈ 0.97 — the default `--alpha` with which `dsjax bench ablate` simulates acceptance:

# %%
alpha_grid = np.linspace(0.5, 0.999, 5000)
implied = alpha_grid[np.argmin(np.abs(expected_length(alpha_grid, 5) - 5.6))]
print(f"E[L] = 5.6 at k = 5  <=>  α ≈ {implied:.3f}; "
      f"at α = 0.97 the closed form gives {expected_length(0.97, 5):.2f}")

# %% [markdown]
# ## 3. The distribution check: rejection sampling is lossless
#
# Speculative sampling must not change *what* is generated: every committed token must be distributed as the
# target's p, however poor the draft. We take the first committed token of N = 20,000 steps drawn with a bad
# drafter (λ = 0: α ≈ 0.3, so about a third of them are accepted drafts and the rest come from the residual) and
# compare its histogram with p by a chi-square test; seeds are fixed and the test passes at p-value > 1e-6, as
# in `tests/test_speculative.py`.
#
# To show the test has teeth, we apply it to a plausible but **wrong** rule as well: accept with
# min(1, p/q) as before, but on a rejection sample from p instead of the residual. That double-counts the
# tokens the draft already favours.

# %%
N_CHECK = 20000
q_bad = draft_dist(0.0)
first = []
for seed in range(5):  # 5 batches of N steps (the jitted function's N), first committed token of each
    _, out = simulate(jnp.asarray(q_bad, jnp.float32), K_MAX, 10 + seed)
    first.append(np.asarray(out[:, 0]))
first = np.concatenate(first)[:N_CHECK]
lossless = np.bincount(first, minlength=V)

gw = np.random.default_rng(2)
d = gw.choice(V, N_CHECK, p=q_bad)
keep = gw.random(N_CHECK) < np.minimum(1, p[d] / q_bad[d])
wrong = np.bincount(np.where(keep, d, gw.choice(V, N_CHECK, p=p)), minlength=V)

for name, counts in (("dsjax accept (residual)", lossless), ("wrong rule (resample from p)", wrong)):
    chi2, pval = stats.chisquare(counts, N_CHECK * p)
    print(f"{name:<30} chi-square {chi2:8.1f} on {V - 1} dof, p-value {pval:.2e}")
assert stats.chisquare(lossless, N_CHECK * p).pvalue > 1e-6
assert stats.chisquare(wrong, N_CHECK * p).pvalue < 1e-6

# %%
fig, ax = plt.subplots(figsize=(11, 3.4))
x = np.arange(V)
ax.bar(x - 0.3, p, 0.2, label="target p", color="k")
ax.bar(x - 0.1, q_bad, 0.2, label="draft q (λ = 0)", color="#bbbbbb")
ax.bar(x + 0.1, lossless / N_CHECK, 0.2, label="first committed token: dsjax", color="C0")
ax.bar(x + 0.3, wrong / N_CHECK, 0.2, label="first committed token: wrong rule", color="C3")
ax.set_xticks(x)
ax.set_xlabel("token")
ax.set_ylabel("probability / frequency")
ax.set_title(f"N = {N_CHECK:,} steps: the residual keeps p exactly; resampling from p drifts toward q", fontsize=10)
ax.legend(fontsize=8, ncol=2)
fig.tight_layout()
plt.show()

# %% [markdown]
# The accepted-draft path and the residual path each produce a distorted distribution; only their sum,
# α·(min(p, q)/α) + (1 − α)·(max(p − q, 0)/(1 − α)) = p, is the target — the whole reason the residual
# exists.
# The test suite runs the same chi-square check on `accept` with top-k filtering and on the DSpark loop's
# Markov-conditioned drafts.
