"""Task domains: the :class:`Domain` interface and its registry (:mod:`.base`), the built-in generated
domains (:mod:`.builtin`), the repository domain with tools (:mod:`.repo`), long documents (:mod:`.longdoc`),
reasoning-gym's datasets as a family (:mod:`.reasoning_gym`) and the field's task-file layouts
(:mod:`.benchmarks`). A new domain is one module registering one :class:`Domain` (docs/extending.md).

(Moved: this package was ``actors.domains``; its modules keep their names under ``domains``,
docs/extending.md lists what moved.)
"""

from domains.base import (DOMAINS, EPISODE_KINDS, HASH_BUCKETS, HELDOUT_BUCKETS, STOP, VERIFIER_REWARDS,
                          Domain, DomainFamily, Episode, Facts, GeneratedTask, RewardBreakdown, Spec,
                          answer_reward, code_reward, is_heldout, load_domain_plugins, register_domain,
                          reward_fn, score, split_rng, terminal_reward, unregister_domain)
from domains.builtin import (CODE_TEST_INPUTS, SHELL_COMMANDS, answer_format, code_format, fenced_code_format,
                             make_arith, make_code, make_docqa, make_math, make_python, make_shell,
                             make_terminal, one_word_format, shell_format, terminal_format)

__all__ = ["CODE_TEST_INPUTS", "DOMAINS", "EPISODE_KINDS", "HASH_BUCKETS", "HELDOUT_BUCKETS", "SHELL_COMMANDS", "STOP",
           "VERIFIER_REWARDS", "Domain", "DomainFamily", "Episode", "Facts", "GeneratedTask", "RewardBreakdown",
           "Spec", "answer_format", "answer_reward", "code_format", "code_reward", "fenced_code_format",
           "is_heldout", "load_domain_plugins", "make_arith", "make_code", "make_docqa", "make_math", "make_python",
           "make_shell", "make_terminal", "one_word_format", "register_domain", "reward_fn", "score",
           "shell_format", "split_rng", "terminal_format", "terminal_reward", "unregister_domain"]
