"""SFT, DPO and RM rows in NeMo RL's formats, read through GRPO's sources: shapes kept, bad rows dropped and named.

Expected records are written by hand from NeMo RL's dataset classes (OpenAIFormatDataset, ResponseDataset,
BinaryPreferenceDataset, PreferenceDataset + preference_preprocessor), not from the code under test.
"""

import json
from pathlib import Path

import pytest
from needs import require_module

from services.common.config import load_config
from services.common.data import DataError, OfflineKeys, load_offline, over_limit, read_offline
from services.common.data.rows import Templates

USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
RESULT = {"role": "tool", "content": "22C, sunny", "tool_call_id": "call_1"}
ANSWER = {"role": "assistant", "content": "22C and sunny."}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}]
TOOL_ROW = {"messages": [USER, CALL, RESULT, ANSWER], "tools": TOOLS}
# What a chat template receives: arguments as an object (as vLLM parses them), content text, nothing null.
TOOL_MESSAGES = [USER, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    RESULT, ANSWER]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_openai_messages_keep_tool_calls_tool_results_and_tools(tmp_path):
    got = read_offline("data.train", str(_jsonl(tmp_path / "t.jsonl", [TOOL_ROW])), "sft")
    (ex,) = got.examples
    assert ex.messages == TOOL_MESSAGES and ex.tools == TOOLS and ex.where == f"{tmp_path / 't.jsonl'}:1"


def test_input_output_row_is_one_user_turn_and_its_answer_as_response_dataset_makes_it(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"question": "1+1?", "answer": "2"}])
    got = read_offline("data.train", str(path), "sft", OfflineKeys(input_key="question", output_key="answer"))
    assert got.examples[0].messages == [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    assert got.examples[0].tools is None


def test_parquet_rows_load_as_jsonl_ones_though_parquet_fills_absent_keys_with_null(tmp_path):
    datasets = require_module("datasets")
    rows = [TOOL_ROW, {"messages": [USER, ANSWER]}]
    # Arrow gives every row every key: the plain row's messages get tool_calls/tool_call_id null, tools null.
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "t.parquet"))
    from_parquet = read_offline("data.train", str(tmp_path / "t.parquet"), "sft")
    from_jsonl = read_offline("data.train", str(_jsonl(tmp_path / "t.jsonl", rows)), "sft")
    as_read = [(e.messages, e.tools) for e in from_jsonl.examples]
    assert [(e.messages, e.tools) for e in from_parquet.examples] == as_read
    assert from_parquet.examples[1].messages == [USER, ANSWER] and from_parquet.examples[0].where.endswith("row 1")


def test_openai_system_prompt_goes_first_and_prompt_file_formats_the_first_user_message(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"messages": [USER, ANSWER]}])
    got = read_offline("data.train", str(path), "sft", OfflineKeys(system_prompt="Be brief."),
                       Templates(prompt="Q: {}\nA:"))
    assert got.examples[0].messages == [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Q: Weather in Paris?\nA:"}, ANSWER]


@pytest.mark.parametrize("prompt, context", [
    ("2+2?", [{"role": "user", "content": "2+2?"}]),
    ([{"role": "system", "content": "Math."}, {"role": "user", "content": "2+2?"}],
     [{"role": "system", "content": "Math."}, {"role": "user", "content": "2+2?"}]),
])
def test_binary_preference_row_is_a_context_and_one_answer_a_side(tmp_path, prompt, context):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": prompt, "chosen": "4", "rejected": "5"}])
    (ex,) = read_offline("data.train", str(path), "preference").examples
    assert ex.context == context
    assert ex.chosen == [{"role": "assistant", "content": "4"}]
    assert ex.rejected == [{"role": "assistant", "content": "5"}]


def test_ranked_completions_prefer_the_lower_rank_whatever_their_order(tmp_path):
    row = {"context": [{"role": "user", "content": "2+2?"}],
           "completions": [{"rank": 1, "completion": [{"role": "assistant", "content": "5"}]},
                           {"rank": 0, "completion": [{"role": "assistant", "content": "4"}]}]}
    (ex,) = read_offline("data.train", str(_jsonl(tmp_path / "p.jsonl", [row])), "preference").examples
    assert ex.chosen[0]["content"] == "4" and ex.rejected[0]["content"] == "5"


def test_sft_rows_with_no_assistant_turn_are_dropped_with_file_line_and_reason(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [
        {"messages": [USER, ANSWER]},
        {"messages": [USER]},                                          # no assistant at all
        {"messages": [USER, {"role": "assistant", "content": "  "}]},  # an empty one
        {"input": "hi", "output": ""},
        {"messages": [USER, ANSWER, {"role": "user", "content": "and?"}]},
    ])
    got = read_offline("data.train", str(path), "sft")
    assert len(got.examples) == 1
    assert [(d.where, d.reason.split(" (")[0]) for d in got.drops] == [
        (f"{path}:2", "no assistant turn"), (f"{path}:3", "no assistant turn"), (f"{path}:4", "no assistant turn"),
        (f"{path}:5", "last message not the assistant's")]
    lines = got.lines()
    assert lines[0].startswith(f"data: data.train: {path}:2: dropped: no assistant turn")
    assert lines[-1] == ("data: data.train: 1 examples kept (4 dropped: 3 no assistant turn, "
                         "1 last message not the assistant's)")


def test_bad_preference_pairs_are_dropped_with_file_line_and_reason(tmp_path):
    ok = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
    two = [{"rank": 0, "completion": [{"role": "assistant", "content": "4"}]},
           {"rank": 0, "completion": [{"role": "assistant", "content": "5"}]}]
    path = _jsonl(tmp_path / "p.jsonl", [
        ok,
        {**ok, "chosen": ""},
        {**ok, "chosen": None},
        {**ok, "rejected": "4"},
        {"context": [{"role": "user", "content": "2+2?"}], "completions": two},
        {"context": [{"role": "user", "content": "2+2?"}], "completions": two + two[:1]},
    ])
    got = read_offline("data.train", str(path), "preference")
    assert len(got.examples) == 1
    assert [(d.where, d.reason.split(" (")[0]) for d in got.drops] == [
        (f"{path}:2", "empty chosen"), (f"{path}:3", "empty chosen"), (f"{path}:4", "chosen equals rejected"),
        (f"{path}:5", "tied ranks"), (f"{path}:6", "not two completions")]


def test_a_file_whose_every_row_is_dropped_is_an_error_naming_the_first_drop(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "chosen": "a", "rejected": "a"}] * 3)
    with pytest.raises(DataError, match=rf"data.train: .*every row was dropped \(3; the first, .*p.jsonl:1: chosen "
                                        r"equals rejected"):
        read_offline("data.train", str(path), "preference")


@pytest.mark.parametrize("kind, row, message", [
    ("preference", {"prompt": "x", "chosen": "a"}, "no 'rejected' key"),
    ("sft", {"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\].role must be one of"),
    ("sft", {"messages": [USER, {**CALL, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "arguments is not valid JSON"),
    ("sft", {"text": "x"}, "no 'input' key"),
])
def test_a_malformed_row_stops_the_load_naming_its_file_and_line(tmp_path, kind, row, message):
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c", "input": "a", "output": "b"},
                                         row])
    with pytest.raises(DataError, match=rf"data.train: {path}:2: .*{message}"):
        read_offline("data.train", str(path), kind)


def test_over_limit_applies_nemo_rls_own_bounds_for_sft_and_for_pairs():
    assert over_limit("sft", (4095,), 4096) is None
    assert "at or over" in over_limit("sft", (4096,), 4096)  # sft_processor: length >= max_seq_length
    assert over_limit("preference", (4096, 10), 4096) is None  # preference_preprocessor: longer side > max
    assert "4097 tokens" in over_limit("preference", (10, 4097), 4096)


def test_load_offline_reads_data_train_and_holds_out_split_validation_size(tmp_path):
    rows = [{"input": f"q{i}", "output": f"a{i}"} for i in range(10)] + [{"input": "q", "output": ""}]
    path = _jsonl(tmp_path / "t.jsonl", rows)
    cfg = load_config(None, ["environments=[]", f"data.train.data_path={path}", "data.train.split_validation_size=0.2",
                             f"data.validation.data_path={path}"])
    got = load_offline(cfg, "sft")
    (train,) = got.train
    held = [s for s in got.validation if s.source == "data.train (split_validation_size)"][0]
    assert len(train.examples) == 8 and len(held.examples) == 2 and len(train.drops) == 1
    assert {e.messages[0]["content"] for e in train.examples + held.examples} == {f"q{i}" for i in range(10)}
    assert any(s.source == "data.validation" and len(s.examples) == 10 for s in got.validation)
