"""Speculative decoding's decisions, pure: which draft tokens to accept, and how many to draft.

A step of speculative decoding (``Generation``, ``client/generation.py``) sends the pending token
and k draft tokens as one Forward; the hop holding the last layer returns the token it picks after
each of those k + 1 positions (``Forward.outputs``; greedy, or seeded per absolute position exactly
as for one token). :func:`accept` keeps the draft while it agrees with those picks, plus the first
pick where it does not (or the pick after the whole draft): 1 to k + 1 tokens a step.

Why this is standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023): both drafts
here propose deterministically (prompt lookup copies; the draft model proposes its argmax), so the
draft distribution q is a point mass on the draft token d. The standard rule accepts d with
probability min(1, p(d)/q(d)) = p(d) and otherwise samples from norm(max(0, p - q)), which is p
without d. Accepting exactly when the target's own sample t ~ p equals d does both: P(accept) =
p(d), and a rejected step returns t, distributed as p given t != d. So every accepted token is the
token a one-token step would have sampled at that position with the same seed: the output follows
the target distribution and is token-identical to non-speculative decoding, greedy or seeded,
whatever the draft (``tests/unit/client/test_speculative.py`` checks the distribution with a chi-square).

:func:`choose_k` picks the draft length that maximises expected tokens per second of a step,
``(1 - a^(k+1)) / (1 - a) / (t0 + k * t_tok)`` for a per-token acceptance rate ``a``, a one-token
step time ``t0`` and a marginal time per extra token ``t_tok``; :class:`SpeculationTuner` measures
all three as the generation runs.
"""

from __future__ import annotations

from typing import Optional, Sequence

from p2pserve.config import SpeculativeConfig



def accept(draft: Sequence[int], target: Sequence[int]) -> list[int]:
    """The tokens a step yields: ``draft`` (k tokens) while it equals ``target`` (k + 1 picks: the
    target's token after the pending token and after each draft token), then one target token."""
    if len(target) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} target tokens, got {len(target)}")
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return list(target[: n + 1])


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step of k draft tokens yields on average at per-token acceptance ``a``:
    1 + a + ... + a^k (the draft is accepted up to its first rejection, plus one target token)."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def choose_k(a: float, t0: float, t_tok: float, max_k: int) -> int:
    """The draft length in [0, max_k] with the most expected tokens per second of step time."""
    best, best_rate = 0, 0.0
    for k in range(max_k + 1):
        rate = expected_tokens(a, k) / max(t0 + k * t_tok, 1e-12)
        if rate > best_rate * (1 + 1e-9):  # the shortest of equally good lengths
            best, best_rate = k, rate
    return best


class SpeculationTuner:
    """Measures acceptance and step times of one generation and chooses each step's k.

    Acceptance: each step that drafted k tokens and accepted n of them is n successes and, if
    n < k, one failure of a per-token Bernoulli; both counts are exponentially smoothed. Times:
    ``t(k) = t0 + k * t_tok`` is fitted by exponentially weighted least squares over the steps'
    (k, seconds); until k has varied, ``t_tok`` is ``prior_token_cost * t0``. Steps that also
    carried a prefill (the first step, a replay after failover) are not timed.
    """

    def __init__(self, config: SpeculativeConfig = SpeculativeConfig()):
        self.config = config
        self.successes = config.prior_acceptance  # one pseudo-trial of the prior
        self.trials = 1.0
        self._fit = [0.0] * 5  # weighted sums of 1, k, k*k, t, k*t
        self._idle = 0  # steps in a row that drafted nothing
        self.drafted = 0  # draft tokens proposed, and accepted, over the generation
        self.accepted = 0

    @property
    def acceptance(self) -> float:
        """The smoothed per-token acceptance rate."""
        return self.successes / self.trials

    def step_time(self) -> tuple[float, float]:
        """The fitted (t0, t_tok) in seconds; (1, prior_token_cost) before any step was timed."""
        w, sk, skk, st, skt = self._fit
        if w <= 0:
            return 1.0, self.config.prior_token_cost
        mk, mt = sk / w, st / w
        var = skk / w - mk * mk
        if var < 1e-6:  # every step had the same k: the intercept alone is not identified
            t0 = mt / (1 + self.config.prior_token_cost * mk)
            return t0, self.config.prior_token_cost * t0
        t_tok = max(0.0, (skt / w - mk * mt) / var)
        return max(mt - t_tok * mk, 1e-9), t_tok

    def next_k(self, room: int) -> int:
        """How many tokens to draft next, given ``room`` (what max_new_tokens and max_length allow)."""
        limit = min(self.config.max_k, room)
        if limit <= 0 or not self.config.adaptive:
            return max(limit, 0)
        t0, t_tok = self.step_time()
        k = choose_k(min(self.acceptance, 0.999), t0, t_tok, limit)
        if k == 0 and self._idle >= self.config.probe_every:
            k = 1
        return k

    def observe(self, drafted: int, accepted: int, seconds: Optional[float]) -> None:
        """Record a step that drafted ``drafted`` tokens and accepted ``accepted`` of them, and took
        ``seconds`` (None: not a plain decode step, do not time it)."""
        w = self.config.smoothing
        if seconds is not None:
            point = (1.0, drafted, drafted * drafted, seconds, drafted * seconds)
            self._fit = [(1 - w) * s + w * x for s, x in zip(self._fit, point)]
        if drafted == 0:
            self._idle += 1
            return
        self._idle = 0
        self.drafted += drafted
        self.accepted += accepted
        failures = 1.0 if accepted < drafted else 0.0
        self.successes = (1 - w) * self.successes + w * accepted
        self.trials = (1 - w) * self.trials + w * (accepted + failures)
