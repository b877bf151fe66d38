"""Multiple-choice items of `python -m utils.evaluate`: the JSON Lines format, read and checked, and the token
sequences each choice is scored on.

One JSON object per line (blank lines skipped):

    {"context": "The capital of France is", "choices": [" Paris", " Rome", " Berlin"], "answer": 0}

`context` a non-empty string; `choices` at least two non-empty strings; `answer` the index of the right one.
A choice's text is encoded on its own and appended to the context's tokens (as lm-evaluation-harness splits
context and continuation), so a choice usually starts with the space that separates it from the context.
A bad line is a one-line error naming the file, the line and what is wrong, before any model is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from utils import ConfigError, require

FORMAT = 'one JSON object a line: {"context": str, "choices": [str, str, ...], "answer": int}'


@dataclass
class Item:
    context: str
    choices: list[str]
    answer: int  # index into choices
    line: int  # 1-based line of the file (errors name it)


@dataclass
class Request:
    """One choice of one item as the model scores it: `ids` (context then choice, cut on the left to the
    model's positions + 1), of which the last `num_scored` are the choice's tokens."""

    item: int
    choice: int
    ids: list[int]
    num_scored: int


def read_items(path: Path) -> list[Item]:
    """The items of a JSON Lines file; ConfigError naming the line of the first bad one."""
    require(path.is_file(), f"{path} is not a file", "--task", "give a .jsonl file of multiple-choice items")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read {path} ({err})", "--task", "give a UTF-8 JSON Lines file") from None
    items = [parse_line(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]
    require(bool(items), f"{path} holds no item", "--task", FORMAT)
    return items


def parse_line(path: Path, number: int, line: str) -> Item:
    where = f"{path} line {number}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where} is not JSON ({err.msg})", "--task", FORMAT) from None
    require(isinstance(obj, dict), f"{where} is a {type(obj).__name__}, not an object", "--task", FORMAT)
    missing = [k for k in ("context", "choices", "answer") if k not in obj]
    require(not missing, f"{where} has no {', '.join(missing)}", "--task", FORMAT)
    context, choices, answer = obj["context"], obj["choices"], obj["answer"]
    require(isinstance(context, str) and context.strip() != "", f"{where}: context is not a non-empty string",
            "--task", FORMAT)
    require(isinstance(choices, list) and len(choices) >= 2, f"{where}: choices is not a list of two or more",
            "--task", FORMAT)
    require(all(isinstance(c, str) and c.strip() != "" for c in choices), f"{where}: a choice is not a non-empty "
            "string", "--task", FORMAT)
    require(isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices),
            f"{where}: answer {answer!r} is not an index of its {len(choices)} choices", "--task",
            f"give an integer from 0 to {len(choices) - 1}")
    return Item(context, choices, answer, number)


def build_requests(items: list[Item], tokenizer, max_positions: int, path: Path) -> list[Request]:
    """Every choice of every item as token ids; ConfigError for a text of no tokens or a choice that does not
    fit the model's positions with one token of context."""
    contexts = tokenizer.encode_batch([item.context for item in items])
    requests = []
    for i, (item, context) in enumerate(zip(items, contexts, strict=True)):
        require(bool(context), f"{path} line {item.line}: the context encodes to no token", "--task",
                "give a context with some text")
        for c, choice in enumerate(tokenizer.encode_batch(item.choices)):
            require(0 < len(choice) <= max_positions, f"{path} line {item.line}: choice {c} has {len(choice)} "
                    f"tokens (the model scores 1 to {max_positions})", "--task", "give shorter, non-empty choices")
            ids = (context + choice)[-(max_positions + 1):]  # the context cut on the left, as a window slides
            requests.append(Request(i, c, ids, len(choice)))
    return requests
