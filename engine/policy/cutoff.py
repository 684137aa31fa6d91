"""The draft cutoff: after each draft step, which chains draft another token."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from engine.policy.contracts import DraftChain, VerifyCurve

if TYPE_CHECKING:
    from engine.policy.goodput import GoodputPolicy


class RoundCutoff:
    """The goodput cutoff for one round (`KeepDrafting`), asked after each draft step.

    A draft step costs about the same however few of its rows go on (a row is a fifteenth of the
    step at batch 4), while each chain that goes on adds its own token to the verify forward
    (whose rows attend one at a time where padding would cost more). So the chains whose next
    drafts save the most go on, as many as pay for the step together and each for its token; all
    in seconds. The prices do not change within a round and are read once; a chain's chance that
    every draft so far is kept grows by a factor a step and is carried from call to call, rather
    than taken over all its drafts at every step.
    """

    def __init__(self, policy: GoodputPolicy, verify_curve: VerifyCurve | None = None) -> None:
        self.policy = policy
        self.step_seconds = policy.costs.draft_step_seconds(policy.batch_size)
        self.token_seconds = policy.costs.verify_fit.slope()
        # Read where every row of a full batch is still drafting: its timed shapes are those.
        self.curve = verify_curve if verify_curve is not None and verify_curve.batch_size == policy.batch_size else None
        # id(chain) -> (the chain, held so that its id is not reused; drafts weighed; all kept)
        self.survived: dict[int, tuple[DraftChain, int, float]] = {}

    def __call__(self, chains: Seq[DraftChain]) -> list[bool]:
        worth = [self.policy.token_worth(chain) for chain in chains]
        if self.step_seconds is None or any(w is None for w in worth):
            return [True] * len(chains)  # nothing measured yet: draft the full k
        saved = [self.next_draft_gain(chain) * w for chain, w in zip(chains, worth)]
        token_seconds = self.token_seconds
        chosen = {i for i, chain in enumerate(chains) if chain.looked_up and saved[i] > token_seconds}
        drafted = [i for i, chain in enumerate(chains) if not chain.looked_up]
        ranked = sorted(drafted, key=lambda i: -saved[i])
        going_on = None
        curve = self.curve if self._on_the_curve(chains) else None
        if curve is not None:
            tokens = len(chains) + sum(len(chain.confidence) for chain in chains)
            going_on = self._most_that_pay(ranked, saved, lambda count: curve.added(tokens, count))
        if going_on is None:
            going_on = self._most_that_pay(ranked, saved, lambda count: count * token_seconds)
        chosen.update(ranked[:going_on])
        return [i in chosen for i in range(len(chains))]

    def _on_the_curve(self, chains: Seq[DraftChain]) -> bool:
        """Whether the verify is priced by the engine's timed curve rather than the fitted line,
        which prices a token alike wherever it falls: where every row of the batch is drafted by
        the model and still drafting, the shapes the curve timed. Rounds of four sampled rows on
        the CPU then verify 16 tokens, the most before the curve steps up, as static k = 3 does,
        rather than 12 or 17 to 20. Not once a lookup joined the round: its rows are ragged, as
        the curve's are not."""
        return (
            self.curve is not None
            and len(chains) == self.curve.batch_size
            and not any(chain.looked_up for chain, _, _ in self.survived.values())
        )

    def _most_that_pay(
        self, ranked: Seq[int], saved: Seq[float], verify_seconds: Callable[[int], float | None]
    ) -> int | None:
        """How many of the chains `ranked` (the most saving first) go on: as many as save the most
        beyond the draft step and `verify_seconds(count)`, what verifying their next drafts adds;
        None where that is not known for some count (beyond the tokens a curve timed)."""
        best, going_on, gained = 0.0, 0, 0.0
        for count, i in enumerate(ranked, start=1):
            verify = verify_seconds(count)
            if verify is None:
                return None
            gained += saved[i]
            surplus = gained - self.step_seconds - verify
            if surplus > best:
                best, going_on = surplus, count
        return going_on

    def next_draft_gain(self, chain: DraftChain) -> float:
        """The chance the chain's next draft is kept: every draft so far must be (the drafter's
        calibrated confidence in each), and then it is as often as drafts of sequences with the
        chain's recent acceptance are. Its own recent acceptance follows a change of traffic at
        once, where rates pooled over all sequences lag behind, and the calibration says how much
        it predicts. Deeper drafts are worth less still, so if the next does not pay, no later
        does. A looked-up token is kept as often as tokens at its depth found by as long a match."""
        drafts = len(chain.confidence)
        _, weighed, survive = self.survived.get(id(chain), (chain, 0, 1.0))
        for j in range(weighed, drafts):
            survive *= self._kept(chain, j)
        self.survived[id(chain)] = (chain, drafts, survive)
        if chain.looked_up:
            return survive * self.policy.lookups.rate(chain.match, drafts)
        return survive * self.policy.calibration[chain.sampled].next_draft(chain.acceptance)

    def _kept(self, chain: DraftChain, j: int) -> float:
        """How likely the chain's draft j is kept when every one before it was."""
        if chain.looked_up:
            return self.policy.lookups.rate(chain.match, j)
        return self.policy.calibration[chain.sampled].probability(chain.confidence[j], chain.acceptance)
