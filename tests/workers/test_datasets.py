"""Datasets and prompt formatting (issue 28 items 1-2).

Aspects under test:
- JSONL, JSON and parquet files give the same rows; field mapping, chat messages, extra columns,
  limit, shuffle and seed;
- every kind of bad dataset is a DatasetError naming the spec field, the file, the line or row
  and the fix: a missing file, a format the extension does not tell, a bad JSON line (with its
  number), a missing field (listing the fields there are), a non-string prompt, a bad message,
  an empty file, a parquet file that is not one;
- the worker refuses such a dataset with the configuration exit code, and the message in the
  container's termination message (what the operator quotes);
- ``chatTemplate: auto``: the engines' prompt ids are exactly
  ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``; a system prompt goes
  first; a tokenizer without a template is refused naming the field;
- the old ``datasetPath`` keeps working.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rljob_workers.config import DatasetConfig, TaskConfig
from rljob_workers.datasets import DatasetError, detect_format, load_rows
from rljob_workers.tasks import chat_messages, format_prompts, load_task_data
from rljob_workers.tinymodel import build_tiny_model

ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7", "id": 1},
    {"question": "Ann has 9 pens and loses 2. How many?", "answer": "9 - 2 = 7\n#### 7", "id": 2},
    {"question": "5 birds and 3 more. How many?", "answer": 8, "id": 3},
]


def _write(path: Path, fmt: str, rows: list[dict[str, Any]]) -> Path:
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(
            pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in rows]), path
        )
    return path


def _config(path: Path, **fields: Any) -> DatasetConfig:
    return DatasetConfig(path=str(path), prompt_field="question", **fields)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_every_format_gives_the_same_rows(tmp_path: Path, fmt: str) -> None:
    path = _write(tmp_path / f"train.{fmt}", fmt, ROWS)
    rows = load_rows(_config(path))
    assert [r.prompt for r in rows] == [r["question"] for r in ROWS]
    assert [r.answer for r in rows] == ["3 + 4 = 7\n#### 7", "9 - 2 = 7\n#### 7", "8"]
    assert [dict(r.extra) for r in rows] == [{"id": 1}, {"id": 2}, {"id": 3}]


def test_limit_shuffle_and_seed(tmp_path: Path) -> None:
    many = [{"question": f"q{i}", "answer": str(i)} for i in range(50)]
    path = _write(tmp_path / "many.jsonl", "jsonl", many)
    first = load_rows(_config(path, limit=5))
    assert [r.answer for r in first] == ["0", "1", "2", "3", "4"]
    a = load_rows(_config(path, limit=5, shuffle=True, seed=1))
    b = load_rows(_config(path, limit=5, shuffle=True, seed=1))
    c = load_rows(_config(path, limit=5, shuffle=True, seed=2))
    assert [r.answer for r in a] == [r.answer for r in b] != [r.answer for r in c]
    assert len({r.answer for r in a}) == 5


def test_chat_rows_keep_their_messages_and_drop_the_answer_turn(tmp_path: Path) -> None:
    chats = [
        {
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
            ],
            "answer": "4",
        }
    ]
    path = _write(tmp_path / "chat.jsonl", "jsonl", chats)
    (row,) = load_rows(DatasetConfig(path=str(path), messages_field="messages"))
    assert row.prompt == ({"role": "user", "content": "2+2?"},)


def _error(tmp_path: Path, content: str | bytes, name: str, **fields: Any) -> str:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(DatasetError) as info:
        load_rows(_config(path, **fields))
    return str(info.value)


def test_a_missing_file_names_the_path_and_the_volume(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as info:
        load_rows(_config(tmp_path / "nope.parquet"))
    assert "spec.task.dataset.path" in str(info.value) and "nope.parquet" in str(info.value)
    assert "mount the volume" in str(info.value)


def test_an_unknown_extension_asks_for_the_format(tmp_path: Path) -> None:
    message = _error(tmp_path, "x", "train.csv")
    assert "spec.task.dataset.format" in message and "jsonl, json, parquet" in message


def test_a_bad_jsonl_line_names_its_number(tmp_path: Path) -> None:
    good = json.dumps(ROWS[0])
    message = _error(tmp_path, f"{good}\n\n{good}\n{{oops\n", "train.jsonl")
    assert "train.jsonl, line 4" in message and "not valid JSON" in message


def test_a_missing_field_lists_the_fields_there_are(tmp_path: Path) -> None:
    message = _error(tmp_path, json.dumps({"q": "x", "answer": "1"}) + "\n", "t.jsonl")
    assert "spec.task.dataset.promptField" in message and "line 1" in message
    assert "no field 'question'" in message and "(its fields: answer, q)" in message
    message = _error(tmp_path, json.dumps({"question": "x", "solution": "1"}) + "\n", "u.jsonl")
    assert "spec.task.dataset.answerField" in message and "no field 'answer'" in message


def test_a_prompt_that_is_not_text_is_refused(tmp_path: Path) -> None:
    message = _error(tmp_path, json.dumps({"question": ["a"], "answer": "1"}) + "\n", "t.jsonl")
    assert "must be a non-empty string" in message and "set messagesField" in message


def test_a_bad_chat_message_is_refused(tmp_path: Path) -> None:
    rows = json.dumps({"m": [{"role": "user"}], "answer": "1"}) + "\n"
    path = tmp_path / "c.jsonl"
    path.write_text(rows)
    with pytest.raises(DatasetError, match=r"messagesField: .*message 0 must be"):
        load_rows(DatasetConfig(path=str(path), messages_field="m"))


def test_an_empty_file_and_a_json_that_is_no_list(tmp_path: Path) -> None:
    assert "holds no rows" in _error(tmp_path, "\n\n", "e.jsonl")
    assert "expected a JSON list" in _error(tmp_path, '"text"', "t.json")


def test_a_file_that_is_not_parquet(tmp_path: Path) -> None:
    message = _error(tmp_path, b"PAR1 not really", "t.parquet")
    assert "not a readable parquet file" in message


def test_detect_format_by_extension() -> None:
    assert detect_format("/d/x.JSONL") == "jsonl"
    assert detect_format("/d/x.parquet") == "parquet"
    assert detect_format("/d/x.txt", "json") == "json"


def test_the_worker_refuses_a_bad_dataset_with_exit_code_2_and_says_why(tmp_path: Path) -> None:
    """What a pod does: exit 2 (the operator fails the job at once, no restart loop) with the
    dataset's problem as the container's termination message."""
    from rljob_workers.config import (
        AlgorithmConfig,
        ModelConfig,
        RolloutConfig,
        SamplingConfig,
        WorkerConfig,
    )

    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps({"question": "x", "answer": "1"}) + "\n{broken\n")
    model = build_tiny_model(tmp_path / "tiny")
    config = WorkerConfig(
        job_name="bad",
        topology="colocated",
        algorithm=AlgorithmConfig(
            name="grpo", advantage_estimator="grpo", batch_size=2, mini_batch_size=2, group_size=2
        ),
        model=ModelConfig(path=str(model)),
        task=TaskConfig(builtin=None, dataset=_config(bad)),
        rollout=RolloutConfig(engine="hf", sampling=SamplingConfig(n=2, max_tokens=2)),
        output_dir=str(tmp_path / "out"),
        total_steps=1,
    )
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(config.dump())
    termination = tmp_path / "termination-log"
    termination.write_text("")
    env = {
        **os.environ,
        "RLJOB_CONFIG": str(tmp_path / "cfg" / "config.json"),
        "RLJOB_ROLE": "actor",
        "RLJOB_TERMINATION_LOG": str(termination),
    }
    done = subprocess.run(
        [sys.executable, "-m", "rljob_workers.main"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    said = termination.read_text()
    assert "train.jsonl, line 2" in said and "not valid JSON" in said
    assert "invalid dataset" in done.stderr


# --------------------------------------------------------------------------- chat templates


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("chat") / "tiny-chat", chat=True)


def test_chat_template_ids_equal_apply_chat_template(chat_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = _write(tmp_path / "train.jsonl", "jsonl", ROWS)
    task = TaskConfig(
        builtin=None,
        dataset=_config(path),
        chat_template="auto",
        system_prompt="Put the final answer in <answer></answer>.",
    )
    data = load_task_data(task, tokenizer_path=str(chat_model))
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    for prompt, row, text in zip(data.prompts, ROWS, data.prompt_texts, strict=True):
        messages = [
            {"role": "system", "content": "Put the final answer in <answer></answer>."},
            {"role": "user", "content": row["question"]},
        ]
        expected = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert prompt == list(expected)
        assert text.endswith("<|im_start|>assistant\n") and row["question"] in text


def test_chat_rows_with_their_own_system_message_keep_it() -> None:
    own = ({"role": "system", "content": "mine"}, {"role": "user", "content": "hi"})
    assert chat_messages(own, "default")[0] == {"role": "system", "content": "mine"}
    assert chat_messages("hi", "sys") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]


def test_a_tokenizer_without_a_template_is_refused_naming_the_field(tmp_path: Path) -> None:
    plain = build_tiny_model(tmp_path / "plain")
    with pytest.raises(DatasetError, match=r"spec\.task\.chatTemplate: auto, but the tokenizer"):
        format_prompts([], "auto", None, tokenizer_path=str(plain))


def test_without_a_template_a_system_prompt_is_text_before_the_prompt() -> None:
    from rljob_workers.datasets import Row

    prompts, texts = format_prompts([Row("2+2=", "4")], "none", "Be brief.", tokenizer_path=None)
    assert prompts == texts == ["Be brief.\n\n2+2="]


def test_the_old_dataset_path_still_works(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({"prompt": "copy:3=", "answer": "3"}) + "\n")
    data = load_task_data(TaskConfig(builtin=None, dataset_path=str(path), num_prompts=0))
    assert list(data.prompts) == ["copy:3="] and list(data.answers) == ["3"]


def test_the_trainer_learns_from_the_engines_own_ids(chat_model: Path, tmp_path: Path) -> None:
    """Item 2: no re-tokenisation between the engine and the trainer. A colocated step over a
    chat-templated dataset: the engine gets the template's ids, and the learner's rows are the
    engine's prompt and response ids, token for token."""
    from rljob_workers.colocated import build_colocated_runtime
    from rljob_workers.config import (
        AlgorithmConfig,
        CheckpointConfig,
        ModelConfig,
        ProcessEnv,
        RewardTermConfig,
        RolloutConfig,
        SamplingConfig,
        WorkerConfig,
    )

    path = _write(tmp_path / "train.jsonl", "jsonl", ROWS)
    config = WorkerConfig(
        job_name="ids",
        topology="colocated",
        algorithm=AlgorithmConfig(
            name="grpo", advantage_estimator="grpo", batch_size=2, mini_batch_size=2, group_size=2
        ),
        model=ModelConfig(path=str(chat_model)),
        task=TaskConfig(
            builtin=None,
            dataset=_config(path),
            chat_template="auto",
            reward_terms=(RewardTermConfig(type="format"),),
        ),
        rollout=RolloutConfig(engine="hf", sampling=SamplingConfig(n=2, max_tokens=6)),
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=100),
        total_steps=1,
    )
    runtime = build_colocated_runtime(config, ProcessEnv(role="actor"))
    generated: list[Any] = []
    trained: list[Any] = []
    generate, update = runtime.engine.generate, runtime.learner.update

    def recording_generate(prompts: Any, **kwargs: Any) -> Any:
        out = generate(prompts, **kwargs)
        generated.extend(out)
        return out

    def recording_update(experience: Any, **kwargs: Any) -> Any:
        trained.append(experience)
        return update(experience, **kwargs)

    runtime.engine.generate = recording_generate  # type: ignore[method-assign]
    runtime.learner.update = recording_update  # type: ignore[method-assign]
    runtime.train_step()
    templated = {tuple(p) for p in runtime.task.prompts}
    assert {tuple(c.prompt_ids) for c in generated} <= templated
    (experience,) = trained
    pairs = {(tuple(c.prompt_ids), tuple(c.token_ids)) for c in generated}
    rows = list(zip(experience.prompt_ids, experience.response_ids, strict=True))
    assert rows and {(tuple(p), tuple(r)) for p, r in rows} <= pairs
