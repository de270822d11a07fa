"""A distillation teacher must share the student's tokenizer and vocabulary (NeMo RL's check_vocab_equality): one
that differs is refused before the run starts, by `flywheel config check` (and `flywheel up`, which runs the same
checks) with the reason named. Teachers here are tiny character-level tokenizers saved as Hugging Face directories."""

import json

import pytest

from services.cli import main
from services.common.config import load_config
from services.common.tokenizing import build_tiny_tokenizer, check_same_vocabulary

STUDENT = load_config(None).policy  # the tiny model


def teacher_dir(tmp_path, *, swap: bool = False, extra: bool = False, vocab_size: int | None = None) -> str:
    """The tiny tokenizer saved with a config.json, optionally altered: two tokens' ids swapped, one token added, or
    the model's vocab_size other than the tokenizer's length (a padded embedding)."""
    tok = build_tiny_tokenizer()
    if swap or extra:
        vocab = tok.get_vocab()
        if swap:
            vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
        if extra:
            vocab["ab"] = len(vocab)
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Whitespace()
        tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                      unk_token="<unk>")
    path = tmp_path / "teacher"
    tok.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size or len(tok)}))
    return str(path)


def test_a_teacher_with_the_students_tokenizer_and_vocab_size_passes(tmp_path):
    check_same_vocabulary(STUDENT, teacher_dir(tmp_path))
    check_same_vocabulary(STUDENT, "tiny")


@pytest.mark.parametrize("change, reason", [
    (dict(swap=True), r"map tokens to ids differently \(2 tokens, e.g. 'a': \d+ vs \d+"),
    (dict(extra=True), r"map tokens to ids differently \(1 tokens, e.g. 'ab': None vs \d+"),
    (dict(vocab_size=128), r"vocab_size .* is 128 for the teacher and \d+ for the student"),
])
def test_a_teacher_whose_vocabulary_differs_is_refused_with_what_differs(tmp_path, change, reason):
    with pytest.raises(ValueError, match=reason):
        check_same_vocabulary(STUDENT, teacher_dir(tmp_path, **change))


def test_config_check_refuses_the_run_before_it_starts(tmp_path, capsys):
    def check(teacher: str) -> int:
        config = tmp_path / "distill.yaml"
        config.write_text(json.dumps({"policy": {"model_name": "tiny"}, "environments": [{"name": "toy", "kind": "toy_copy"}],
                                      "distillation": {"max_num_steps": 2}, "teacher": {"model_name": teacher}}))
        return main(["config", "check", str(config)])

    assert check(teacher_dir(tmp_path, swap=True)) == 2
    assert "config error: teacher.model_name: " in capsys.readouterr().err
    assert check("tiny") == 0
