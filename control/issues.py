"""What a configuration that cannot be used reports: every problem, each naming its key."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from control.bounded import clip


@dataclass(frozen=True)
class ConfigIssue:
    path: str  # "adaptive.candidate_k", "adaptive.slots[1].min_batch_size", "<file>", "<toml>"
    message: str

    def __post_init__(self) -> None:
        # Whatever the file held, an error quotes a bounded part of it: a 10 MB value must not
        # make every status reply and log line 10 MB.
        object.__setattr__(self, "path", clip(self.path, 120))
        object.__setattr__(self, "message", clip(self.message, 400))

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


MAX_ISSUES = 50  # a file of a million bad keys is reported by its first ones


class ConfigError(Exception):
    """A configuration that cannot be used; `issues` holds every problem found, not just the first."""

    def __init__(self, issues: Sequence[ConfigIssue]) -> None:
        self.issues = list(issues[:MAX_ISSUES])
        if len(issues) > MAX_ISSUES:
            self.issues.append(ConfigIssue("<file>", f"{len(issues) - MAX_ISSUES} more problems not listed"))
        super().__init__("\n".join(str(issue) for issue in self.issues))
