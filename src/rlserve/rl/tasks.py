"""Tasks with a verifiable reward: seeded prompts and a scorer that needs no model.

A task hands out `Problem`s (a chat prompt and the exact answer) and scores a completion's
text. `Arithmetic` is the demo's: sampled at temperature 1, SmolLM2-135M-Instruct ends about
15% of its answers to a one-digit sum with the right number and starts about 25% with a
number at all (measured on 192 samples), so a group of eight usually has rewards to compare.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Protocol

INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    question: str  # the user's turn of the chat
    answer: str
    system: str = ""  # the system turn, if any


class Task(Protocol):
    def problems(self, n: int) -> list[Problem]: ...

    def reward(self, problem: Problem, completion: str) -> float: ...


class Arithmetic:
    """'What is 7 + 5?' with the system turn 'Answer with only the number.': reward 1 when the
    last number in the completion is the answer, plus 0.25 when the completion starts with a
    number (the format asked for, and the easier half to learn). Prompts come from `seed`."""

    SYSTEM = "Answer with only the number."
    FORMAT_BONUS = 0.25

    def __init__(self, *, seed: int = 0, max_operand: int = 9, ops: str = "+") -> None:
        if max_operand < 1 or not ops or set(ops) - set("+-*"):
            raise ValueError("need max_operand >= 1 and ops drawn from '+-*'")
        self._rng = random.Random(seed)
        self._max, self._ops = max_operand, ops

    def problems(self, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            a, b = self._rng.randint(0, self._max), self._rng.randint(0, self._max)
            op = self._rng.choice(self._ops)
            value = a + b if op == "+" else a - b if op == "-" else a * b
            out.append(Problem(f"What is {a} {op} {b}?", str(value), self.SYSTEM))
        return out

    def reward(self, problem: Problem, completion: str) -> float:
        numbers = INTEGER.findall(completion)
        correct = 1.0 if numbers and numbers[-1] == problem.answer else 0.0
        starts_with_number = INTEGER.match(completion.lstrip()) is not None
        return correct + (self.FORMAT_BONUS if starts_with_number else 0.0)
