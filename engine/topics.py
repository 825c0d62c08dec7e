"""Topic, bucket and subject names of one deployment, all under its namespace."""

from __future__ import annotations

import dataclasses

# topic suffix -> what it carries (docs/wire-schemas.md has the schemas)
TOPIC_SUFFIXES = (
    "tasks",
    "tasks.published",
    "tokens",
    "sandbox.requests",
    "sandbox.results",
    "completions",
    "outcomes",
    "experience",
    "dlq",
    "eval",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Names:
    """Every name a deployment uses, derived from its namespace."""

    namespace: str

    def topic(self, suffix: str) -> str:
        if suffix not in TOPIC_SUFFIXES:
            raise ValueError(f"unknown topic {suffix!r}; one of {TOPIC_SUFFIXES}")
        return f"{self.namespace}.rollout.{suffix}"

    @property
    def tasks(self) -> str:
        return self.topic("tasks")

    @property
    def published_tasks(self) -> str:
        """Users' tasks published with `rollout tasks publish`; schedulers with ``published_tasks`` issue them."""
        return self.topic("tasks.published")

    @property
    def tokens(self) -> str:
        return self.topic("tokens")

    @property
    def sandbox_requests(self) -> str:
        return self.topic("sandbox.requests")

    @property
    def sandbox_results(self) -> str:
        return self.topic("sandbox.results")

    @property
    def completions(self) -> str:
        return self.topic("completions")

    @property
    def outcomes(self) -> str:
        return self.topic("outcomes")

    @property
    def experience(self) -> str:
        return self.topic("experience")

    @property
    def dlq(self) -> str:
        return self.topic("dlq")

    @property
    def eval(self) -> str:
        """Held-out evaluation results of the ``eval`` actor, one record per domain and weight version."""
        return self.topic("eval")

    def group(self, role: str) -> str:
        """Kafka consumer group of a role."""
        return f"{self.namespace}.{role}"

    def bucket(self, name: str) -> str:
        """JetStream bucket names allow only [A-Za-z0-9_-]."""
        return f"{self.namespace}-{name}".replace(".", "-")

    def subject(self, *parts: str) -> str:
        return ".".join((self.namespace, *parts))

    WEIGHTS_KEY = "weights.latest"
    LEARNER_VERSION_KEY = "learner.version"
    EVAL_STATUS_KEY = "eval.status"
    """The eval role's latest held-out accuracy per domain, its best and regression flag (actors/eval_role.py)."""
