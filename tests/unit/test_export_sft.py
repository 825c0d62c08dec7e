"""The SFT view of `rollout export --sft`: which records count as successful, and the chat messages decoded
from their token ids (ChatML-rendered sequences by turn, raw-text ones by loss-mask runs)."""

from __future__ import annotations

import numpy as np
import pytest

from actors.export import SftView
from modelserver.llm import build_char_tokenizer
from engine.schemas import Experience

TOK = build_char_tokenizer()


def _exp(prompt: str, parts: list[tuple[str, int]], *, reward: float = 1.0, correctness: float | None = 1.0,
         **facts: object) -> Experience:
    response: list[int] = []
    mask: list[int] = []
    for text, m in parts:
        ids = TOK.encode(text, add_special_tokens=False)
        response += ids
        mask += [m] * len(ids)
    if correctness is not None:
        facts["reward_terms"] = {"correctness": correctness, "format": 0.0, "tokens": len(response)}
    n = len(response)
    return Experience(sample_id="s", task_id="t", domain="math",
                      prompt_ids=np.array(TOK.encode(prompt, add_special_tokens=False), dtype=np.int32),
                      response_ids=np.array(response, dtype=np.int32), logprobs=np.zeros(n, dtype=np.float32),
                      loss_mask=np.array(mask, dtype=np.uint8), weight_versions=np.zeros(n, dtype=np.int32),
                      reward=reward, advantage=0.0, group_size=1, facts=dict(facts))


def test_chatml_sequences_split_into_their_turns() -> None:
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nList the files.<|im_end|>\n<|im_start|>assistant\n"
    exp = _exp(prompt, [("ls<|im_end|>", 1), ("\n<|im_start|>tool\na.txt b.txt<|im_end|>\n<|im_start|>assistant\n", 0),
                        ("done<|im_end|>", 1)])
    assert SftView(TOK).row(exp) == {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "ls"}, {"role": "tool", "content": "a.txt b.txt"},
        {"role": "assistant", "content": "done"}]}


def test_raw_text_sequences_split_by_loss_mask_runs() -> None:
    exp = _exp("Make a.txt\n", [("touch a.txt\n", 1), ("$ exit 0\n", 0), ("done", 1)])
    assert SftView(TOK).messages(exp) == [
        {"role": "user", "content": "Make a.txt"}, {"role": "assistant", "content": "touch a.txt"},
        {"role": "tool", "content": "$ exit 0"}, {"role": "assistant", "content": "done"}]


@pytest.mark.parametrize("kwargs, min_reward, kept", [
    ({"correctness": 1.0, "reward": 0.9}, None, True),          # solved, whatever the shaped reward
    ({"correctness": 0.5, "reward": 0.5}, None, False),         # partial credit is not solved
    ({"correctness": 0.5, "reward": 0.5}, 0.5, True),           # ... unless the threshold says so
    ({"correctness": 1.0, "reward": 0.4}, 0.5, False),          # the threshold is on the reward
    ({"correctness": None, "reward": 1.0}, None, True),         # no reward terms: the reward is the correctness
    ({"correctness": 1.0, "reward": 1.0, "verifier_error": "timeout"}, None, False),
])
def test_success_threshold(kwargs: dict[str, object], min_reward: float | None, kept: bool) -> None:
    exp = _exp("q\n", [("a", 1)], **kwargs)  # type: ignore[arg-type]
    assert (SftView(TOK, min_reward).row(exp) is not None) is kept
