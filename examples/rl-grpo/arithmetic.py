"""The task: single-digit addition, answered as one digit token then end-of-sequence.

Vocabulary (16 tokens): 0 padding, 1 end-of-sequence, 2 ``+``, 3 ``=``, 4-13 the digits 0-9,
14-15 unused. A prompt is ``a + b =`` with ``a + b <= 9``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

PAD = 0
EOS = 1
PLUS = 2
EQUALS = 3
VOCAB_SIZE = 16


def digit(value: int) -> int:
    """The token of a decimal digit."""
    return 4 + value


def decode(tokens: Sequence[int]) -> str:
    """Readable text of tokens (for logs)."""
    names = {PAD: "_", EOS: "$", PLUS: "+", EQUALS: "="}
    return "".join(names.get(t, str(t - 4) if 4 <= t <= 13 else "?") for t in tokens)


def arithmetic_prompts(*, step: int, dp_rank: int, count: int) -> list[list[int]]:
    """``count`` prompts ``a+b=``, a function of the step and rank (so a resumed run repeats them)."""
    generator = torch.Generator().manual_seed(1_000_003 * step + dp_rank)
    prompts: list[list[int]] = []
    while len(prompts) < count:
        a, b = (int(v) for v in torch.randint(0, 10, (2,), generator=generator))
        if a + b <= 9:
            prompts.append([digit(a), PLUS, digit(b), EQUALS])
    return prompts


def balanced_prompts(*, step: int, dp_rank: int, count: int) -> list[list[int]]:
    """Like ``arithmetic_prompts`` but every answer 0-9 equally likely (the sum first, then ``a``).

    Uniform pairs make 9 the answer of 10 prompts in 55 and 0 of one: a policy that learns the
    prior ("9") first is rewarded for it. Drawing the answer uniformly removes that shortcut.
    """
    generator = torch.Generator().manual_seed(1_000_003 * step + dp_rank)
    prompts: list[list[int]] = []
    for _ in range(count):
        total = int(torch.randint(0, 10, (1,), generator=generator))
        a = int(torch.randint(0, total + 1, (1,), generator=generator))
        prompts.append([digit(a), PLUS, digit(total - a), EQUALS])
    return prompts


def all_prompts() -> list[list[int]]:
    """Every prompt of the task: the 55 pairs ``a+b=`` with ``a + b <= 9`` (the whole table)."""
    return [[digit(a), PLUS, digit(b), EQUALS] for a in range(10) for b in range(10 - a)]


def answer_of(prompt: Sequence[int]) -> int:
    """The token of the right answer to ``a+b=``."""
    return digit((prompt[0] - 4) + (prompt[2] - 4))


def greedy_accuracy(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> float:
    """Share of completions that are exactly the right digit then the end token."""
    right = sum(list(c) == [answer_of(p), EOS] for p, c in zip(prompts, completions, strict=True))
    return right / max(len(prompts), 1)


def shaped_reward(*, prompt: Sequence[int], completion: Sequence[int]) -> float:
    """Partial credit by distance: ``1 - |guess - answer| / 10`` for a digit first, 0 otherwise,

    plus 0.5 for ending right after it: at most 1.5, and within a group a closer guess always
    scores higher, so even a group without the right digit carries a signal toward it.
    """
    reward = 0.0
    if len(completion) >= 1 and 4 <= completion[0] <= 13:
        reward = 1.0 - abs(completion[0] - answer_of(prompt)) / 10.0
    if len(completion) == 2 and completion[1] == EOS:
        reward += 0.5
    return reward


def arithmetic_reward(*, prompt: Sequence[int], completion: Sequence[int]) -> float:
    """1 for the right digit first, plus 0.5 for ending right after it: at most 1.5."""
    answer = digit((prompt[0] - 4) + (prompt[2] - 4))
    reward = 1.0 if len(completion) >= 1 and completion[0] == answer else 0.0
    if len(completion) == 2 and completion[1] == EOS:
        reward += 0.5
    return reward
