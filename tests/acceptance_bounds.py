"""The closed-form check both speculative loops' corrupted-oracle tests make: drafts kept with probability alpha
give a mean acceptance length (1 - alpha^(k+1)) / (1 - alpha), within 6 sigma of the per-step spread."""


def assert_closed_form_acceptance(gens, alpha: float, k: int, seed: int, min_steps: float) -> None:
    acc = sum(g.stats["accepted"] for g in gens)
    steps = sum(g.stats["row_steps"] for g in gens)
    mean_len = 1 + acc / steps
    expect = (1 - alpha ** (k + 1)) / (1 - alpha)
    # accepted drafts per step: P(a >= j) = alpha^j, j <= k; its std bounds the mean over `steps` steps
    ea = sum(alpha ** j for j in range(1, k + 1))
    var = sum((2 * j - 1) * alpha ** j for j in range(1, k + 1)) - ea ** 2
    bound = 6 * (var / steps) ** 0.5
    print(f"seed {seed}: {steps} steps, mean acceptance length {mean_len:.3f}, closed form {expect:.3f} ± {bound:.3f}")
    assert steps >= min_steps
    assert abs(mean_len - expect) <= bound
