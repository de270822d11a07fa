"""NeMo RL's 151 GRPO-family example configs (tests/fixtures/nemo_rl, at its commit 7ea279a) through `flywheel
config check` with the one documented edit: how many pass, and that each of the others fails for the reason
docs/nemo_rl_mapping.md lists for it.

"Pass" is what `flywheel config check` runs short of reading the datasets (which needs the Hugging Face hub): the
composed, translated and validated config, and the trackers it enables importable.
"""

import re
from pathlib import Path

import pytest

from services.common.config import ConfigError, load
from services.controller.tracking import TrackerError, check_trackers

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "tests/fixtures/nemo_rl/examples/configs"
EDITS = ["policy.generation.colocated.enabled=false"]
PASSING = 92
"""Configs that pass today; the doc's table lists the others."""


def recipes() -> list[Path]:
    """NeMo RL's GRPO family: grpo, gdpo and prorlv2 at the top level, and those with dapo among the recipes."""
    top = [p for p in CONFIGS.glob("*.yaml") if p.name.startswith(("grpo", "gdpo", "prorlv2"))]
    llm = [p for p in (CONFIGS / "recipes/llm").glob("*.yaml")
           if p.name.startswith(("grpo-", "gdpo-", "prorlv2-", "dapo-"))]
    return sorted(top + llm)


def refused(path: Path) -> set[str]:
    """The dotted keys `flywheel config check` names in its errors for `path`; empty when it passes."""
    try:
        cfg, _ = load(path, EDITS)
        check_trackers(cfg)
    except ConfigError as err:
        return {line.split(": ")[1] for line in str(err).splitlines()}
    except TrackerError as err:
        return {str(err).split(":")[0]}
    return set()


def table() -> list[tuple[str, str, str]]:
    """docs/nemo_rl_mapping.md's table of the configs that do not pass: (path under examples/configs, the key,
    how many other keys are refused)."""
    doc = (ROOT / "docs/nemo_rl_mapping.md").read_text()
    section = doc.split("### NeMo RL's example configs that do not pass", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+\.yaml)` \| `([^`]+)` \| (\d+) \|$", section, flags=re.M)


def listed() -> dict[str, str]:
    return {name: key for name, key, _ in table()}


@pytest.fixture(scope="module")
def results() -> dict[str, set[str]]:
    """Each config's refused keys, with HF_HOME set as NeMo RL's launchers set it (its NeMo Gym recipes read their
    data and venvs from under it)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HOME", "/hf_home")
        return {str(p.relative_to(CONFIGS)): refused(p) for p in recipes()}


def test_the_fixture_holds_nemo_rls_151_grpo_family_configs():
    assert len(recipes()) == 151


def test_at_least_this_many_pass_and_the_doc_lists_exactly_the_others(results):
    failing = {name for name, keys in results.items() if keys}
    assert len(results) - len(failing) >= PASSING
    assert set(listed()) == failing


def test_each_config_that_does_not_pass_is_refused_for_its_listed_reason_and_as_many_others(results):
    wrong = {name: (key, others, sorted(results[name])) for name, key, others in table()
             if key not in results[name] or int(others) != len(results[name]) - 1}
    assert wrong == {}


def test_the_megatron_and_wandb_recipes_pass(results):
    """The issue's two largest groups: Megatron-Core's keys (grpo_math_1B_megatron.yaml with the one edit) and
    logger.wandb_enabled, whose package is installed with the base dependencies."""
    assert results["grpo_math_1B_megatron.yaml"] == set() == results["grpo_math_70B_megatron.yaml"]
    assert results["gdpo_math_1B.yaml"] == set()  # wandb_enabled: true
    assert results["recipes/llm/grpo-llama3.2-1b-instruct-1n8g-megatron.yaml"] == set()
