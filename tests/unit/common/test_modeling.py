import torch

from services.common.config import PolicyConfig
from services.common.modeling import load_policy


def test_a_local_checkpoint_loads_through_the_same_code_as_a_hub_id(tmp_path):
    tiny, tokenizer = load_policy(PolicyConfig(), seed=7)
    tiny.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    model, loaded_tokenizer = load_policy(PolicyConfig(model_name=str(tmp_path)), seed=0)

    expected = tiny.state_dict()
    assert model.state_dict().keys() == expected.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    messages = [{"role": "user", "content": "copy 3"}]
    assert (loaded_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def test_the_tiny_model_is_the_same_for_the_same_seed():
    a, _ = load_policy(PolicyConfig(), seed=3)
    b, _ = load_policy(PolicyConfig(), seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
