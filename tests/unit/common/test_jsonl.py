"""The run's JSONL files are read while their writer appends (tests, `flywheel status`, the launcher)."""

from services.common.jsonl import complete_rows, read_rows


def test_a_row_still_being_written_is_left_for_the_next_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 1.5}\n{"step": 1, "lo')
    assert read_rows(path) == [{"step": 0, "loss": 1.5}]
    with path.open("a") as f:
        f.write('ss": 1.25}\n')
    assert read_rows(path) == [{"step": 0, "loss": 1.5}, {"step": 1, "loss": 1.25}]


def test_no_file_and_blank_lines_are_no_rows(tmp_path):
    assert read_rows(tmp_path / "absent.jsonl") == []
    assert complete_rows('\n{"a": 1}\n\n') == [{"a": 1}]
