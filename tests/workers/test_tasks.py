"""Toy tasks and rewards.

Aspects under test:
- task generation is deterministic by seed and differs across seeds
- every built-in task's answers are correct and single digits in the tokenizer's alphabet
- unknown tasks and bad JSONL files fail with messages that name the task / file:line / field
- JSONL datasets load, and are sampled deterministically by seed
- exact-match reward: exact, whitespace / eos tolerant, partial credit, wrong
- load_reward_function: built-in name, import path, and errors naming the bad path
"""

from __future__ import annotations

import json

import pytest

from rljob_workers.tasks import (
    DEFAULT_TASK,
    PARTIAL_CREDIT,
    TASKS,
    TaskExample,
    builtin_task_names,
    exact_match_reward,
    generate_examples,
    load_examples,
    load_jsonl_examples,
    load_reward_function,
)
from rljob_workers.tinymodel import ALPHABET


def test_generate_examples_same_seed_same_examples():
    assert generate_examples("add-mod10", 50, seed=3) == generate_examples("add-mod10", 50, seed=3)


def test_generate_examples_other_seed_other_examples():
    assert generate_examples("add-mod10", 50, seed=3) != generate_examples("add-mod10", 50, seed=4)


@pytest.mark.parametrize(
    ("task", "prompt", "answer"),
    [("copy", "copy:7=", "7"), ("successor", "next:7=", "8"), ("successor", "next:9=", "0"),
     ("add-mod10", "3+4=", "7"), ("add-mod10", "8+5=", "3")],
)  # fmt: skip
def test_generate_examples_known_prompt_expected_answer(task, prompt, answer):
    examples = generate_examples(task, 400, seed=0)
    assert TaskExample(prompt, answer) in examples
    assert all(len(e.answer) == 1 and e.answer.isdigit() for e in examples)
    assert all(set(e.prompt) <= set(ALPHABET) for e in examples)


def test_builtin_task_names_include_default():
    assert DEFAULT_TASK in builtin_task_names() == sorted(TASKS)


def test_generate_examples_unknown_task_names_known_ones():
    with pytest.raises(ValueError, match=r"unknown built-in task 'nope'.*add-mod10"):
        generate_examples("nope", 1, seed=0)


def test_load_examples_jsonl_path_reads_records(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "2+2=", "answer": "4"}\n\n{"prompt": "a", "answer": "b"}\n')
    assert load_jsonl_examples(path) == [TaskExample("2+2=", "4"), TaskExample("a", "b")]
    assert load_examples(str(path), 0, seed=0) == load_jsonl_examples(path)
    sampled = load_examples(str(path), 20, seed=1)
    assert len(sampled) == 20 and sampled == load_examples(str(path), 20, seed=1)


@pytest.mark.parametrize(
    ("line", "message"),
    [("not json", "not valid JSON"), ('["x"]', "expected an object"),
     ('{"prompt": "p"}', "'answer' must be a string"),
     ('{"prompt": 1, "answer": "a"}', "'prompt' must be a string")],
)  # fmt: skip
def test_load_jsonl_examples_bad_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "answer": "ok"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*{message}"):
        load_jsonl_examples(path)


def test_load_examples_neither_task_nor_file_raises():
    with pytest.raises(ValueError, match="neither a built-in task"):
        load_examples("/no/such/file.jsonl", 1, seed=0)


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [("7", "7", 1.0), (" 7\n", "7", 1.0), ("7</s>", "7", 1.0), ("7 </s><pad>", "7", 1.0),
     ("77", "7", PARTIAL_CREDIT), ("7=", "7", PARTIAL_CREDIT), ("8", "7", 0.0), ("", "7", 0.0),
     ("</s>", "7", 0.0), ("12", "12", 1.0), ("13", "12", PARTIAL_CREDIT)],
)  # fmt: skip
def test_exact_match_reward_cases(response, answer, reward):
    assert exact_match_reward(response, answer) == reward


def test_load_reward_function_builtin_and_import_path_resolve():
    assert load_reward_function("exact-match") is exact_match_reward
    assert load_reward_function("rljob_workers.tasks:exact_match_reward") is exact_match_reward
    assert load_reward_function("os.path:join") is not None


@pytest.mark.parametrize(
    ("path", "message"),
    [("no_colon", "expected 'package.module:function'"),
     ("rljob_no_such_module:f", "cannot import module 'rljob_no_such_module'"),
     ("rljob_workers.tasks:missing", "has no attribute 'missing'"),
     ("rljob_workers.tasks:DEFAULT_TASK", "is not callable")],
)  # fmt: skip
def test_load_reward_function_bad_path_names_it(path, message):
    with pytest.raises(ValueError, match=f"reward function '{path}': .*{message}"):
        load_reward_function(path)
