"""``bench.plan_table``: aspects under test

- the table of ``rljob plan`` verdicts in docs/concepts/plan.md for Qwen2.5 shapes is the
  script's output (it
  goes stale when the estimate changes);
- the script's Qwen2.5 shapes give the parameter counts of the published models;
- the verdicts a user would rely on: a 7B fits 8 × 80 GB with fsdp and never with ddp, a 72B
  needs cpuOffload on 8 GPUs, and a rollout engine of 32B needs tensor parallel 2 and of 72B 4
  (none holds either on one GPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.plan_table import QWEN25, plan_for, render_table, trainer_cell
from rljob_operator.plan import ModelShape

PLAN_PAGE = Path(__file__).resolve().parents[2] / "docs" / "concepts" / "plan.md"
BEGIN, END = "<!-- bench.plan_table -->", "<!-- /bench.plan_table -->"

# the Qwen2.5 model cards' "Number of Parameters" (total, non-embedding), billions
PUBLISHED = {
    "Qwen2.5-0.5B": (0.49, 0.36),
    "Qwen2.5-1.5B": (1.54, 1.31),
    "Qwen2.5-7B": (7.61, 6.53),
    "Qwen2.5-32B": (32.5, 31.0),
    "Qwen2.5-72B": (72.7, 70.0),
}


def test_readme_table_is_the_scripts_output() -> None:
    text = PLAN_PAGE.read_text()
    table = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    assert table.strip() == render_table().strip(), "run python -m bench.plan_table"


@pytest.mark.parametrize("name", list(QWEN25))
def test_qwen25_shapes_have_the_published_parameter_counts(name: str) -> None:
    shape = ModelShape.from_config(QWEN25[name], source=name)
    total, non_embedding = PUBLISHED[name]
    assert shape.parameters() / 1e9 == pytest.approx(total, rel=0.01)
    embeddings = shape.root_parameters() - shape.hidden_size
    assert (shape.parameters() - embeddings) / 1e9 == pytest.approx(non_embedding, rel=0.01)


def test_table_verdicts_7b_fsdp_not_ddp_72b_offload_big_engines_need_tensor_parallel() -> None:
    shape = {name: ModelShape.from_config(c, source=name) for name, c in QWEN25.items()}
    assert trainer_cell(shape["Qwen2.5-7B"], 8).startswith("fits: fsdp")
    for world in (8, 16):
        ddp = plan_for(
            shape["Qwen2.5-7B"], world, {"sharding": "ddp", "gradientCheckpointing": True}
        )
        assert {p.verdict for p in ddp.pods if p.role == "trainer"} == {"does-not-fit"}
    assert trainer_cell(shape["Qwen2.5-72B"], 8).startswith(
        "fits: fsdp + checkpointing + cpuOffload"
    )
    rows = {line.split(" | ")[0].strip("| "): line for line in render_table().splitlines()}
    rollout = {name: rows[name].rsplit(" | ", 1)[1] for name in QWEN25}
    assert rollout["Qwen2.5-7B"].startswith("fits: TP 1,")
    assert rollout["Qwen2.5-32B"].startswith("fits: TP 2,")  # one GPU's share holds no 32B
    assert rollout["Qwen2.5-72B"].startswith("fits: TP 4,")
