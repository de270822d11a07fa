"""`flywheel data from-gym`: NeMo Gym rollouts -> SFT rows and DPO pairs that data.train loads back.

The fixture tests/fixtures/gym/rollouts.jsonl is written by hand in NeMo Gym's rollout shape (its README names
the upstream files it follows: environments/workplace_assistant/data/example_rollouts.jsonl,
nemo_gym/openai_utils.py, nemo_gym/rollout_collection.py). Expected chat messages are written by hand from
NeMo Gym's down-conversion rules (nemo_gym/responses_converter.py), not from the code under test.
"""

import json
from pathlib import Path

import pytest

from services.cli import main
from services.common.data import read_offline
from services.common.data.from_gym import GymDataError, convert, dpo_rows, read_rollouts, sft_rows

ROLLOUTS = Path(__file__).resolve().parents[2] / "fixtures/gym/rollouts.jsonl"
SYSTEM = {"role": "system", "content": "You are a careful assistant. Use the calculator for arithmetic."}
USER = {"role": "user", "content": "What is 47 × 23?"}
# Line 1: reasoning + function_call merge into one assistant turn; the output becomes a tool message.
EPISODE_1 = [
    {"role": "assistant", "content": "<think>I should multiply with the tool.</think>", "tool_calls": [
        {"id": "call_a0", "type": "function",
         "function": {"name": "calculator", "arguments": {"expression": "47 * 23"}}}]},
    {"role": "tool", "content": "1081", "tool_call_id": "call_a0"},
    {"role": "assistant", "content": "47 × 23 = 1081."},
]
CALCULATOR = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression and returns the result.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 47 * 23"}},
                   "required": ["expression"], "additionalProperties": False}}}]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(*argv: str, capsys) -> tuple[int, str]:
    code = main(["data", "from-gym", *argv])
    return code, capsys.readouterr().out


def test_a_tool_call_rollout_becomes_openai_chat_messages_with_its_tools(tmp_path):
    convert(ROLLOUTS, "sft", tmp_path / "sft.jsonl", min_reward=1.0, min_gap=0.5)
    first = _lines(tmp_path / "sft.jsonl")[0]
    assert first["messages"] == [SYSTEM, USER, *EPISODE_1]
    assert first["tools"] == CALCULATOR and first["source"] == f"{ROLLOUTS}:1"


def test_sft_keeps_exactly_the_rollouts_at_or_above_the_reward_threshold():
    rollouts, _ = read_rollouts(ROLLOUTS)
    kept = {r["source"].rsplit(":", 1)[1] for r in sft_rows(rollouts, 1.0)[0]}
    assert kept == {"1", "5", "6", "7"}  # line 8 scores 1 but ends on a tool result; line 4 has no reward
    assert {r["source"].rsplit(":", 1)[1] for r in sft_rows(rollouts, 0.5)[0]} == {"1", "3", "5", "6", "7"}


def test_instructions_and_input_text_parts_become_one_system_and_one_user_message():
    rollouts, _ = read_rollouts(ROLLOUTS)
    (line_7,) = [r for r in rollouts if r.where.endswith(":7")]
    assert line_7.prompt == [{"role": "system", "content": "Answer with the word only."},
                             {"role": "user", "content": "Spell 'cat' backwards."}]
    assert line_7.tools is None


def test_dpo_pairs_a_prompts_best_rollout_against_its_worst_when_the_gap_is_wide_enough():
    rollouts, _ = read_rollouts(ROLLOUTS)
    rows, drops, between = dpo_rows(rollouts, 0.5)
    (pair,) = rows
    assert pair["context"] == [SYSTEM, USER] and pair["tools"] == CALCULATOR
    assert pair["completions"] == [{"rank": 0, "completion": EPISODE_1},
                                   {"rank": 1, "completion": [{"role": "assistant", "content": "About 1000."}]}]
    assert (pair["reward_chosen"], pair["reward_rejected"], between) == (1.0, 0.0, 1)  # line 3 (0.5) sits between
    assert {d.reason.split(" (")[0] for d in drops} == {"reward gap below --min-gap 0.5",
                                                         "the only rollout of its prompt"}
    assert dpo_rows(rollouts, 1.01)[0] == []


def test_every_rollout_left_out_is_printed_with_its_line_and_reason(tmp_path, capsys):
    code, out = _run(str(ROLLOUTS), "--to", "sft", "--out", str(tmp_path / "sft.jsonl"), capsys=capsys)
    assert code == 0
    assert f"{ROLLOUTS}:4: dropped: no reward" in out
    assert f"{ROLLOUTS}:2: dropped: reward below --min-reward 1 (0)" in out
    assert f"{ROLLOUTS}:8: dropped: last message not the assistant's" in out
    assert out.splitlines()[-1] == (
        f"from-gym: {ROLLOUTS}: rollouts read: 7, lines unusable: 1; SFT rows: 4, written to {tmp_path / 'sft.jsonl'}; "
        "dropped: 1 no reward, 2 reward below --min-reward 1, 1 last message not the assistant's")


def test_written_sft_and_dpo_files_load_back_through_the_offline_loaders(tmp_path):
    convert(ROLLOUTS, "sft", tmp_path / "sft.jsonl", min_reward=1.0, min_gap=0.5)
    convert(ROLLOUTS, "dpo", tmp_path / "dpo.jsonl", min_reward=1.0, min_gap=0.5)
    sft = read_offline("data.train", str(tmp_path / "sft.jsonl"), "sft")
    assert not sft.drops
    assert [e.messages for e in sft.examples] == [r["messages"] for r in _lines(tmp_path / "sft.jsonl")]
    assert sft.examples[0].messages == [SYSTEM, USER, *EPISODE_1] and sft.examples[0].tools == CALCULATOR
    (pair,) = read_offline("data.train", str(tmp_path / "dpo.jsonl"), "preference").examples
    assert (pair.context, pair.chosen, pair.tools) == ([SYSTEM, USER], EPISODE_1, CALCULATOR)
    assert pair.rejected == [{"role": "assistant", "content": "About 1000."}]


def test_a_rollout_file_with_no_reward_is_an_error_and_writes_nothing(tmp_path, capsys):
    unscored = tmp_path / "unscored.jsonl"
    unscored.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "reward"}) + "\n"
                                for r in _lines(ROLLOUTS)))
    code, out = _run(str(unscored), "--to", "dpo", "--out", str(tmp_path / "dpo.jsonl"), capsys=capsys)
    assert code == 2 and not (tmp_path / "dpo.jsonl").exists()
    assert f"{unscored}:1: dropped: no reward" in out and f"{unscored}:8: dropped: no reward" in out
    assert "no DPO row kept, nothing written" in out


def test_a_truncated_line_and_items_with_no_chat_form_are_counted_drops(tmp_path):
    rows = _lines(ROLLOUTS)
    hosted = {**rows[0], "response": {"output": [{"type": "mcp_call", "name": "search"}]}}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(hosted) + "\n" + json.dumps(rows[1])[:50] + "\n")
    rollouts, drops = read_rollouts(path)
    assert len(rollouts) == 1
    assert [(d.where, d.reason.split(" (")[0]) for d in drops] == [
        (f"{path}:2", "a mcp_call item has no chat form"), (f"{path}:3", "not a JSON line")]


def test_a_top_level_output_list_is_read_as_nemo_gym_training_docs_show_it(tmp_path):
    # The shape in NeMo Gym's training docs: `output` beside `reward`, items without ids or call_ids.
    row = {"responses_create_params": {"input": [{"role": "user", "content": "What is 47 × 23?"}],
                                       "tools": [{"type": "function", "name": "calculator"}]},
           "output": [{"type": "function_call", "name": "calculator", "arguments": "{\"expression\": \"47 * 23\"}"},
                      {"type": "function_call_output", "output": "1081"},
                      {"type": "message", "content": [{"text": "The answer is 1,081"}]}],
           "reward": 1.0, "accuracy": 1.0}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(row) + "\n")
    convert(path, "sft", tmp_path / "sft.jsonl", min_reward=1.0, min_gap=0.5)
    (ex,) = read_offline("data.train", str(tmp_path / "sft.jsonl"), "sft").examples
    assert ex.messages == [
        {"role": "user", "content": "What is 47 × 23?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "47 * 23"}}}]},
        {"role": "tool", "content": "1081"}, {"role": "assistant", "content": "The answer is 1,081"}]
    assert ex.tools == [{"type": "function", "function": {"name": "calculator"}}]


def test_out_must_be_jsonl_so_data_train_reads_it(tmp_path):
    with pytest.raises(GymDataError, match="must end in .jsonl"):
        convert(ROLLOUTS, "sft", tmp_path / "sft.parquet", min_reward=1.0, min_gap=0.5)
