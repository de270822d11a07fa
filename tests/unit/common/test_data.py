"""Datasets as NeMo RL reads them: formats, prompt files, splits, epochs, and errors that name file and line."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from needs import require_module

from services.common.config import load_config
from services.common.structs import from_struct
from services.common.data import DataError, load_data, load_rows, plan_steps
from services.common.data.plan import holdout, planned_steps
from services.common.data.rows import RowError, Templates, to_row
from services.controller.datasets import EpochCursor, Exhausted

ROOT = Path(__file__).resolve().parents[3]
COT = (ROOT / "tests/fixtures/nemo_rl/examples/prompts/cot.txt").read_text()


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _cfg(tmp_path, train: Path, *extra: str):
    return load_config(None, ["environments=[]", f"data.train.data_path={train}", *extra])


@pytest.mark.parametrize("record, ground_truth", [
    ({"problem": "1+1?", "expected_answer": "2"}, "2"),
    ({"input": "1+1?", "output": "2"}, "2"),
    ({"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}, "2"),
])
def test_each_nemo_rl_format_gives_the_problem_and_its_ground_truth(record, ground_truth):
    row = to_row(record, None, None, Templates())
    assert row == {"messages": [{"role": "user", "content": "1+1?"}], "metadata": {"ground_truth": ground_truth}}


def test_cot_prompt_file_and_system_prompt_wrap_the_problem_as_math_hf_data_processor_does():
    row = to_row({"question": "What is 2+3?", "answer": "5"}, "question", "answer",
                 Templates(prompt=COT, system="You are careful."))
    system, user = row["messages"]
    assert system == {"role": "system", "content": "You are careful."}
    assert user["content"] == COT.format("What is 2+3?") and "What is 2+3?" in user["content"]
    assert "\\\\boxed{}" in user["content"]  # cot.txt's {{}} is a literal {} after str.format


@pytest.mark.parametrize("record, message", [
    ({"problem": "x"}, "no 'expected_answer' key"),
    ({"text": "x"}, "no messages, problem or input key"),
    ({"messages": [{"role": "assistant", "content": "4"}]}, "no prompt"),
    ([1, 2], "must be a JSON object"),
])
def test_a_malformed_record_says_what_is_wrong(record, message):
    with pytest.raises(RowError, match=message):
        to_row(record, None, None, Templates())


def test_a_malformed_row_is_one_error_naming_file_and_line(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"problem": "a", "expected_answer": "1"}, "{not json",
                                              {"problem": "b", "expected_answer": "2"}])
    with pytest.raises(DataError) as err:
        load_data(_cfg(tmp_path, train))
    assert str(err.value).startswith(f"data.train: {train}:2: not valid JSON") and "\n" not in str(err.value)
    _jsonl(train, [{"problem": "a", "expected_answer": "1"}, {"problem": "b"}])
    with pytest.raises(DataError, match=f"{train}:2: no 'expected_answer' key"):
        load_data(_cfg(tmp_path, train))


def test_a_missing_prompt_file_names_the_key_and_the_file(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"problem": "a", "expected_answer": "1"}])
    with pytest.raises(DataError, match="data.train.prompt_file: nope/cot.txt: No such file"):
        load_data(_cfg(tmp_path, train, "data.train.prompt_file=nope/cot.txt"))


def test_parquet_and_a_saved_datasets_directory_load_like_jsonl(tmp_path):
    datasets = require_module("datasets")
    rows = [{"problem": f"{i}+1", "expected_answer": str(i + 1)} for i in range(5)]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "t.parquet"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "saved"))
    expected = load_rows(str(_jsonl(tmp_path / "t.jsonl", rows)))
    assert load_rows(str(tmp_path / "t.parquet")) == expected == load_rows(str(tmp_path / "saved"))


def test_split_validation_size_holds_out_a_seeded_disjoint_part(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"problem": str(i), "expected_answer": str(i)} for i in range(40)])
    data = load_data(_cfg(tmp_path, train, "data.train.split_validation_size=0.1"))
    held = {from_struct(r.metadata)["ground_truth"] for r in data.validation[0].rows}
    kept = {from_struct(r.metadata)["ground_truth"] for r in data.train[0].rows}
    assert len(held) == 4 and len(kept) == 36 and not held & kept
    assert holdout(40, 0.1, 7) == holdout(40, 0.1, 7) != holdout(40, 0.1, 8)


def test_epochs_bound_the_steps_and_drop_each_epochs_last_partial_step(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"problem": str(i), "expected_answer": str(i)} for i in range(10)])
    cfg = _cfg(tmp_path, train, "grpo.num_prompts_per_step=3", "grpo.max_num_epochs=2", "grpo.max_num_steps=100")
    assert plan_steps(cfg, load_data(cfg)) == 6 == planned_steps(100, 2, 10, 3)
    assert planned_steps(4, 2, 10, 3) == 4


def _walk(cursor: EpochCursor) -> list[str]:
    async def go():
        out = []
        while True:
            try:
                out.append((await cursor.next())[0])
            except Exhausted:
                return out
    return asyncio.run(go())


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_epoch_leases_each_kept_row_once_in_a_fresh_order(shuffle):
    cursor = EpochCursor(list(range(10)), prompts_per_step=3, epochs=3, seed=1, shuffle=shuffle)
    ids = _walk(cursor)
    epochs = [[i.split("/")[1] for i in ids if i.startswith(f"e{e}/")] for e in range(3)]
    assert len(ids) == 27 and all(len(set(e)) == 9 for e in epochs)  # 10 rows, 3 per step: one dropped
    assert (epochs[0] != epochs[1]) == shuffle


def test_a_cursor_resumed_at_an_offset_continues_the_same_order():
    whole = _walk(EpochCursor(list(range(10)), prompts_per_step=3, epochs=2, seed=5, shuffle=True))
    resumed = _walk(EpochCursor(list(range(10)), prompts_per_step=3, epochs=2, seed=5, shuffle=True, offset=7))
    assert resumed == whole[7:]


def test_bad_data_stops_flywheel_up_before_anything_starts(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"problem": "a"}])
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "up", "--run-dir", str(run_dir), "environments=[]",
                           f"data.train.data_path={train}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not run_dir.exists()
    assert proc.stderr.strip() == f"data error: data.train: {train}:1: no 'expected_answer' key (keys: problem)"


def test_openmathinstruct2_with_a_local_data_path_reads_its_columns_from_the_file(tmp_path):
    train = _jsonl(tmp_path / "omi2.jsonl", [{"problem": "2+2?", "expected_answer": "4", "generated_solution": "..."}])
    data = load_data(_cfg(tmp_path, train, "data.train.dataset_name=OpenMathInstruct-2"))
    (row,) = data.train[0].rows
    assert row.messages[0].content == "2+2?" and from_struct(row.metadata) == {"ground_truth": "4"}
    _jsonl(train, [{"input": "2+2?", "output": "4"}])
    with pytest.raises(DataError, match=f"{train}:1: no 'problem' key"):
        load_data(_cfg(tmp_path, train, "data.train.dataset_name=OpenMathInstruct-2"))


@pytest.mark.parametrize("name, record, problem, answer", [
    ("DAPOMath17K", {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Solve x+1=3."}],
                     "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"}}, "Solve x+1=3.", "2"),
    ("DAPOMathAIME2024", {"prompt": [{"role": "user", "content": "AIME?"}], "reward_model": {"ground_truth": "204"}},
     "AIME?", "204"),
    ("gsm8k", {"question": "3 apples and 4 more?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}, "3 apples and 4 more?", "7"),
    ("GSM8K", {"question": "q", "answer": "work\n#### 1,000"}, "q", "1,000"),
    ("DeepScaler", {"problem": "p", "answer": "\\frac{1}{2}", "solution": "..."}, "p", "\\frac{1}{2}"),
    ("AIME2024", {"id": 60, "problem": "p", "answer": 204, "solution": "..."}, "p", "204"),
])
def test_a_named_nemo_rl_dataset_reads_its_own_record_shape(tmp_path, name, record, problem, answer):
    """The hub is unreachable here: a local copy (data_path) of records shaped as on the hub takes the same path."""
    train = _jsonl(tmp_path / "train.jsonl", [record])
    data = load_data(_cfg(tmp_path, train, f"data.train.dataset_name={name}"))
    (row,) = data.train[0].rows
    assert row.messages[0].content == problem and from_struct(row.metadata) == {"ground_truth": answer}


def test_a_named_dataset_nemo_rl_never_splits_ignores_split_validation_size_and_says_so(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "reward_model": {"ground_truth": str(i)}}
            for i in range(40)]
    train = _jsonl(tmp_path / "train.jsonl", rows)
    data = load_data(_cfg(tmp_path, train, "data.train.dataset_name=DAPOMath17K",
                          "data.train.split_validation_size=0.1"))
    assert len(data.train[0].rows) == 40 and not data.validation
    assert data.notes == ["data: data.train: split_validation_size ignored: NeMo RL's DAPOMath17K takes no hold-out "
                          "(give it a validation set instead)"]
    omi2 = _jsonl(tmp_path / "omi2.jsonl", [{"problem": f"q{i}", "expected_answer": "1"} for i in range(40)])
    split = load_data(_cfg(tmp_path, omi2, "data.train.dataset_name=OpenMathInstruct-2",
                           "data.train.split_validation_size=0.1"))
    assert len(split.train[0].rows) == 36 and len(split.validation[0].rows) == 4 and not split.notes


def test_gsm8k_without_its_answer_marker_is_a_row_error(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"question": "q", "answer": "7"}])
    with pytest.raises(DataError, match=f"{train}:1: the answer holds no '####'"):
        load_data(_cfg(tmp_path, train, "data.train.dataset_name=gsm8k"))


def test_repeat_gives_the_rows_that_many_times_over_as_nemo_rls_aime_validation(tmp_path):
    """As NeMo RL's deepscaler recipes write it: validation {dataset_name: AIME2024, repeat: 16}."""
    train = _jsonl(tmp_path / "train.jsonl", [{"problem": "t", "expected_answer": "1"}])
    aime = _jsonl(tmp_path / "aime.jsonl", [{"problem": f"p{i}", "answer": i} for i in range(2)])
    data = load_data(_cfg(tmp_path, train, "+data.validation={dataset_name: AIME2024, repeat: 3}",
                          f"data.validation.data_path={aime}"))
    assert [r.messages[0].content for r in data.validation[0].rows] == ["p0", "p1"] * 3
    assert len(data.train[0].rows) == 1


@pytest.mark.parametrize("name, where", [("train.jsonl", ":2: not UTF-8 text (byte 0xff at offset 1)"),
                                         ("train.json", ": not UTF-8 text (byte 0xff at offset 42)")])
def test_a_file_that_is_not_utf8_is_one_error_naming_file_line_and_byte(tmp_path, name, where):
    """A fuzz run found a SubmitEnvironment naming such a file answered INTERNAL (UnicodeDecodeError)."""
    path = tmp_path / name
    path.write_bytes(b'{"problem": "a", "expected_answer": "1"}\n\x00\xff not json\n')
    with pytest.raises(DataError) as err:
        load_rows(str(path))
    assert f"{path}{where}" in str(err.value)


def test_a_prompt_file_that_is_not_utf8_names_the_key_the_file_and_the_byte(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"problem": "a", "expected_answer": "1"}])
    prompt = tmp_path / "cot.txt"
    prompt.write_bytes(b"\xff{}")
    with pytest.raises(DataError, match=rf"data.train.prompt_file: {prompt}: not UTF-8 text \(byte 0xff at offset 0\)"):
        load_data(_cfg(tmp_path, train, f"data.train.prompt_file={prompt}"))
