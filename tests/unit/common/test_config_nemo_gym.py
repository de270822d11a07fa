"""NeMo RL's NeMo Gym yaml through the config mapping (services/common/nemo_rl_gym.py): the one documented edit is
all it needs and is needed, and its keys land where docs/nemo_rl_mapping.md ("NeMo RL's NeMo Gym configs")
says. The e2e run of the same yaml is tests/integration/test_nemo_gym_e2e.py."""

from pathlib import Path

import pytest

from services.common.config import ConfigError, load, load_config
from services.common.nemo_rl_gym import GYM_CHECKOUT, resolve_gym_path

ROOT = Path(__file__).resolve().parents[3]
GDPO = ROOT / "tests/fixtures/nemo_rl/examples/nemo_gym/gdpo_example_tool_call_multireward.yaml"
EDITS = ["policy.generation.colocated.enabled=false"]
DATA = "resources_servers/example_tool_call_multireward/data/example.jsonl"


def test_the_gdpo_nemo_gym_yaml_is_one_nemo_gym_agent_environment_with_its_dataset():
    cfg = load_config(GDPO, EDITS)
    [env] = cfg.environments
    assert (env.name, env.kind, env.agent["type"]) == ("nemo_gym", "agent", "nemo_gym")
    assert env.agent["config_paths"] == ["responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
                                         "resources_servers/example_tool_call_multireward/configs/"
                                         "example_tool_call_multireward.yaml"]
    assert env.agent["overrides"]["port_range_low"] == 5000 and "is_trajectory_collection" not in env.agent["overrides"]
    assert env.dataset == resolve_gym_path(GYM_CHECKOUT + DATA)
    assert cfg.data.train is None and cfg.data.default is None
    assert (cfg.data.validation.env_name, cfg.data.validation.data_path) == ("nemo_gym", env.dataset)  # the same file
    assert cfg.policy.generation.endpoint.enabled  # expose_http_server
    assert cfg.policy.generation.tool_parser == "nemotron_json"  # http_server_serving_chat_kwargs.tool_parser
    assert cfg.grpo.adv_estimator.name == "gdpo"


@pytest.mark.parametrize("edit", EDITS)
def test_each_edit_is_needed_and_its_key_is_named(edit):
    key = edit.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(GDPO, [e for e in EDITS if e != edit])


def test_a_nemo_gym_validation_set_of_another_environment_is_refused():
    with pytest.raises(ConfigError, match=r"data\.validation"):
        load_config(GDPO, [*EDITS, "data.validation.env_name=other"])


def test_the_doc_lists_the_edit():
    doc = (ROOT / "docs/nemo_rl_mapping.md").read_text().split("### NeMo RL's NeMo Gym configs", 1)[1]
    assert all(f"`{e}`" in doc.split("What the mapping does", 1)[0] for e in EDITS)


def test_a_gym_checkout_path_is_read_from_the_working_directory_when_it_is_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / GYM_CHECKOUT).mkdir(parents=True)
    (tmp_path / GYM_CHECKOUT / "rows.jsonl").write_text("{}\n")
    assert resolve_gym_path(GYM_CHECKOUT + "rows.jsonl") == GYM_CHECKOUT + "rows.jsonl"


def test_a_gym_checkout_path_is_read_from_the_nemo_gym_package_otherwise(tmp_path, monkeypatch):
    site = tmp_path / "venv/lib/python3.12/site-packages"
    (site / "resources_servers").mkdir(parents=True)
    monkeypatch.setenv("FLYWHEEL_GYM_VENV", str(tmp_path / "venv"))
    assert resolve_gym_path(GYM_CHECKOUT + DATA) == str(site / DATA)
    assert resolve_gym_path("other/rows.jsonl") == "other/rows.jsonl"


@pytest.mark.parametrize("override, key", [
    ("env.nemo_gym.is_trajectory_collection=true", "env.nemo_gym.is_trajectory_collection"),
    ("data.train.prompt_file=p.txt", "data.train"),
    ("~env.nemo_gym.config_paths", "env.nemo_gym.config_paths"),
    ("policy.generation.vllm_cfg.skip_tokenizer_init=true", "policy.generation.vllm_cfg.skip_tokenizer_init"),
    ("policy.megatron_cfg.scheduler.lr_decay_iters=null", "policy.megatron_cfg.train_iters"),
])
def test_what_flywheel_cannot_honour_in_a_nemo_gym_config_is_refused(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(GDPO, [*EDITS, override])


def test_with_nemo_gym_off_its_section_is_accepted_as_inert():
    cfg, notes = load(GDPO, [*EDITS, "env.should_use_nemo_gym=false", "data.train=null", "~data.default",
                             "++environments=[{name: toy, kind: toy_copy}]"])
    assert [e.name for e in cfg.environments] == ["toy"]
    assert any(key == "env.nemo_gym" for key, _ in notes)


def test_the_nemotron_super_recipes_agent_keys_land_on_the_endpoint_and_the_trainer():
    """What NeMo RL's Nemotron-3-Super stages ask of agents (stage3_rlhf's values): the advantage overrides for
    flawed turns on the trainer, the flaw markers (which NeMo RL reads, not NeMo Gym) and the reasoning parser on
    rollout, vLLM's server-wide template kwargs on the tokenizer; the keys NeMo RL never reads accepted."""
    cfg, notes = load(GDPO, [*EDITS, "++grpo.invalid_tool_call_advantage=-5.0",
                             "++grpo.malformed_thinking_advantage=-5.0", "++grpo.penalize_invalid_tool_call=true",
                             "grpo.async_grpo.max_generation_failures=3",
                             "++env.nemo_gym.invalid_tool_call_patterns=[<tool_call>,'[TOOL]']",
                             "++env.nemo_gym.thinking_tags=[<think>,</think>]",
                             "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.reasoning_parser=deepseek_r1",
                             "++policy.generation.vllm_cfg.http_server_serving_chat_kwargs.default_chat_template_kwargs"
                             ".enable_thinking=true"])
    assert (cfg.grpo.invalid_tool_call_advantage, cfg.grpo.malformed_thinking_advantage) == (-5.0, -5.0)
    g = cfg.policy.generation
    assert g.invalid_tool_call_patterns == ["<tool_call>", "[TOOL]"] and g.thinking_tags == ["<think>", "</think>"]
    [env] = cfg.environments
    assert not {"invalid_tool_call_patterns", "thinking_tags"} & set(env.agent["overrides"])  # not NeMo Gym's
    assert cfg.policy.generation.reasoning_parser == "deepseek_r1"
    assert cfg.policy.tokenizer.chat_template_kwargs == {"enable_thinking": True}
    noted = {key for key, _ in notes}
    assert {"grpo.penalize_invalid_tool_call", "grpo.async_grpo.max_generation_failures"} <= noted


def test_server_template_kwargs_that_disagree_with_the_tokenizers_are_refused():
    with pytest.raises(ConfigError, match=r"default_chat_template_kwargs: sets \['enable_thinking'\]"):
        load_config(GDPO, [*EDITS, "++policy.tokenizer.chat_template_kwargs.enable_thinking=false",
                           "++policy.generation.vllm_cfg.http_server_serving_chat_kwargs.default_chat_template_kwargs"
                           ".enable_thinking=true"])
