"""SFT and DPO end to end on the toy copy task: `flywheel up`'s services (replay, controller, trainer; no
rollout, no environment), the tiny model on CPU, data made from the toy environment's own prompts.

SFT rows are the prompts with the correct answer as the assistant turn; each completion token
("a", ":", the digit, newline, EOS) is determined by the prompt, so the loss floor is 0. The
exported model is scored by the toy environment itself (its reward, not this code's), greedy, with
no RL. DPO pairs prefer the correct digit to a wrong one; accuracy is measured on held-out pairs.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest
import torch
import yaml

from services.common.config import load_config
from services.environment.envs.toy_copy import DIGITS, ToyCopyEnvironment
from services.local import LocalStack, read_metrics
from services.trainer.export import export_checkpoint


RM_GRPO_STEPS = 40


def toy_rows(count: int, seed: int) -> list[dict]:
    return ToyCopyEnvironment().prompts(count, seed, 0)


def write_sft(path, count: int, seed: int) -> None:
    rows = [{"messages": r["messages"] + [{"role": "assistant", "content": r["metadata"]["ground_truth"]}]}
            for r in toy_rows(count, seed)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_pairs(path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for r in toy_rows(count, seed):
        digit = int(r["metadata"]["ground_truth"])
        wrong = (digit + rng.randrange(1, DIGITS)) % DIGITS
        rows.append({"prompt": r["messages"][0]["content"], "chosen": str(digit), "rejected": str(wrong)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run(tmp_path, section: dict, steps: int, steps_timeout_s: float = 600):
    """Start the offline services on tmp_path/config.yaml and wait for the final step; the metrics rows."""
    config = {**section, "policy": {"model_name": "tiny", "train_global_batch_size": 16, "train_micro_batch_size": 8,
                                    "max_total_sequence_length": 32},
              "data": {"train": {"data_path": str(tmp_path / "train.jsonl")},
                       "validation": {"data_path": str(tmp_path / "val.jsonl")}},
              "checkpointing": {"save_period": 25}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    cfg = load_config(tmp_path / "config.yaml")
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        assert set(stack.children.procs) == {"nats", "redis", "replay", "controller", "trainer"}
        rows = stack.wait_for(lambda rs: len(rs) >= steps, f"{steps} steps", timeout_s=steps_timeout_s)
    return rows, [json.loads(line) for line in (tmp_path / "run" / "validation.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sft_takes_validation_loss_near_its_floor_and_the_export_solves_the_toy_task(tmp_path):
    write_sft(tmp_path / "train.jsonl", 400, seed=1)
    write_sft(tmp_path / "val.jsonl", 40, seed=2)
    rows, validations = run(tmp_path, {"sft": {"max_num_steps": 60, "max_num_epochs": 3, "val_period": 20,
                                               "val_at_start": True}}, steps=60)
    assert [r["step"] for r in rows] == list(range(60))
    losses = [v["validation/val_loss"] for v in validations]
    print("sft validation loss by version:", {v["version"]: round(v["validation/val_loss"], 4) for v in validations})
    assert [v["version"] for v in validations] == [0, 20, 40, 60]
    assert losses[-1] < 0.05 < 1.0 < losses[0], losses  # floor 0: every completion token follows from the prompt

    out = export_checkpoint(tmp_path / "run" / "checkpoints", tmp_path / "export")
    assert out.name == "step_60"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export")
    prompts = toy_rows(40, seed=3)
    answers = []
    for r in prompts:
        ids = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            out_ids = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answers.append(tokenizer.decode(out_ids[0, ids.shape[1]:], skip_special_tokens=True))
    results = ToyCopyEnvironment().step([r["messages"] + [{"role": "assistant", "content": a}]
                                         for r, a in zip(prompts, answers)], [r["metadata"] for r in prompts])
    reward = sum(x.reward for x in results) / len(results)
    print("exported SFT model, toy_copy reward (greedy, 40 new prompts):", reward)
    assert reward >= 0.9, list(zip(answers, [r["metadata"] for r in prompts]))

    # GRPO starts from the export (NeMo RL's SFT-then-GRPO): its first batch, sampled at temperature 1 by rollout
    # from the loaded weights and scored by the toy environment, is already near the ceiling the tiny random
    # model starts far below (0.1: one digit in ten).
    grpo = load_config(None, ["grpo.max_num_steps=2", "checkpointing.enabled=false",
                              f"policy.model_name={tmp_path / 'export'}"])
    with LocalStack(grpo, tmp_path / "grpo") as stack:
        stack.start_services()
        grpo_rows = stack.wait_for(lambda rs: len(rs) >= 2, "2 GRPO steps", timeout_s=600)
    print("GRPO from the SFT export, toy_copy reward by step:", [r["train/reward_mean"] for r in grpo_rows])
    assert grpo_rows[0]["train/reward_mean"] >= 0.8


@pytest.mark.slow
def test_dpo_on_toy_pairs_takes_held_out_accuracy_up_and_raises_the_chosen_responses(tmp_path):
    write_pairs(tmp_path / "train.jsonl", 400, seed=1)
    write_pairs(tmp_path / "val.jsonl", 40, seed=2)
    rows, validations = run(tmp_path, {"dpo": {"max_num_steps": 25, "val_period": 25, "val_at_start": True,
                                               "reference_policy_kl_penalty": 0.1}}, steps=25)
    first, last = validations[0], validations[-1]
    print("dpo held-out validation:", first, last)
    assert [first["version"], last["version"]] == [0, 25]
    assert first["validation/accuracy"] == 0.0  # policy == reference: every margin is 0, none > 0
    assert last["validation/accuracy"] >= 0.9, last
    assert last["validation/rewards_chosen_mean"] > 0 > last["validation/rewards_rejected_mean"], last
    assert last["validation/preference_loss"] < first["validation/preference_loss"]
    assert {"train/loss", "train/accuracy", "train/rewards_chosen_mean", "train/preference_loss"} <= set(rows[-1])


NEMO_RL_SFT = Path(__file__).resolve().parents[1] / "fixtures/nemo_rl/examples/configs/sft.yaml"


@pytest.mark.slow
def test_nemo_rl_sft_yaml_runs_with_its_two_edits_and_logs_nemo_rl_names_to_tensorboard(tmp_path):
    """NeMo RL's own sft.yaml: the two documented edits (local copies of its datasets), then only what makes it a
    CPU test (the tiny model, a batch and learning rate it learns with, no W&B login)."""
    write_sft(tmp_path / "train.jsonl", 400, seed=1)
    write_sft(tmp_path / "val.jsonl", 40, seed=2)
    edits = [f"++data.train.data_path={tmp_path / 'train.jsonl'}", f"++data.validation.data_path={tmp_path / 'val.jsonl'}"]
    cpu = ["policy.model_name=tiny", "logger.wandb_enabled=false", "policy.train_global_batch_size=16",
           "policy.train_micro_batch_size=8", "policy.optimizer.kwargs.lr=0.003", "policy.optimizer.kwargs.weight_decay=0",
           f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "sft.max_num_steps=20"]
    cfg = load_config(NEMO_RL_SFT, edits + cpu)
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        stack.wait_for(lambda rs: len(rs) >= 20, "20 steps", timeout_s=600)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "logs" / "tensorboard"))
    events.Reload()
    val = {s.step: s.value for s in events.Scalars("validation/val_loss")}
    print("NeMo RL sft.yaml on the tiny model, validation/val_loss in TensorBoard:", val)
    assert sorted(val) == [10, 20] and val[20] < val[10]  # sft.val_period 10; val_at_start's v0 is in the jsonl
    assert "train/loss" in events.Tags()["scalars"]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_10", "step_20"]  # save_period 10


@pytest.mark.slow
def test_rm_on_toy_pairs_reaches_held_out_accuracy_and_its_export_scores_as_flywheel_serve_reward_model_does(tmp_path):
    write_pairs(tmp_path / "train.jsonl", 400, seed=1)
    write_pairs(tmp_path / "val.jsonl", 40, seed=2)
    rows, validations = run(tmp_path, {"rm": {"max_num_steps": -1, "max_num_epochs": 6, "val_period": 75,
                                              "val_at_start": True}}, steps=150)  # 6 epochs of 400 // 16
    print("rm held-out validation:", validations[0], validations[-1])
    assert len(rows) == 150 and validations[-1]["version"] == 150
    assert validations[-1]["validation/accuracy"] >= 0.9 > validations[0]["validation/accuracy"]

    export_checkpoint(tmp_path / "run" / "checkpoints", tmp_path / "export")
    from services.common.config_data import RewardModelEnvConfig
    from services.rollout.reward_model import RewardModel

    served = RewardModel(RewardModelEnvConfig(model_name=str(tmp_path / "export"), precision="float32"))
    pairs = [json.loads(line) for line in (tmp_path / "val.jsonl").read_text().splitlines()]
    scored = [served.score([[{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p[side]}]
                            for side in ("chosen", "rejected")]) for p in pairs]
    accuracy = sum(c > r for c, r in scored) / len(scored)
    print("exported reward model served by flywheel serve reward_model's scorer, held-out pair accuracy:", accuracy)
    assert accuracy >= 0.9

    # Its scores drive GRPO (NeMo RL's grpo_rm): toy prompts, every episode scored by `flywheel serve reward_model`
    # on the export, no other reward. The tiny policy starts random, so the scores it earns rise as it learns.
    rows = [{"messages": r["messages"]} for r in toy_rows(16 * RM_GRPO_STEPS, seed=4)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    grpo = load_config(None, [f"grpo.max_num_steps={RM_GRPO_STEPS}", "grpo.num_prompts_per_step=16",
                              "checkpointing.enabled=false", "environments=[]",  # not the default run's toy_copy
                              f"++data.train={{data_path: {tmp_path / 'prompts.jsonl'}, env_name: reward_model}}",
                              f"++env.reward_model={{model_name: {tmp_path / 'export'}, precision: float32}}"])
    assert grpo.uses_reward_model and not grpo.environments
    with LocalStack(grpo, tmp_path / "grpo") as stack:
        stack.start_services()
        grpo_rows = stack.wait_for(lambda rs: len(rs) >= RM_GRPO_STEPS, "GRPO steps", timeout_s=600)
    scores = [r["train/reward_mean/reward_model"] for r in grpo_rows]
    print("GRPO on the trained reward model's scores, by step:", [round(x, 3) for x in scores])
    # A step's mean score varies by ~1.5 with its 16 prompts (the reward model scores some digits higher), so the
    # first and last 10 steps are compared, by a margin of about 1.5 standard errors of their difference.
    first, last = statistics.mean(scores[:10]), statistics.mean(scores[-10:])
    assert last > first + 1.0, (first, last)
