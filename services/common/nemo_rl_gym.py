"""NeMo RL's NeMo Gym configs -> a `nemo_gym` agent environment (docs/nemo_rl_mapping.md, "NeMo Gym").

    env.should_use_nemo_gym + env.nemo_gym ──▶ environments += {name: data's env_name, kind: agent,
                                                 agent: nemo_rl_agent_spec(env.nemo_gym), dataset: data.train's}
    data.train (NemoGymDataset)             ──▶ that environment's dataset: NeMo Gym rows (rows.gym_row)
    data.validation (NemoGymDataset)        ──▶ data.validation: {data_path, env_name: that environment}, whose
                                                 prompts rollout's Generate runs through the agent, as training

NeMo RL opens a NemoGymDataset's data_path relative to its checkout, where `3rdparty/Gym-workspace/Gym` is
NeMo Gym's source tree; Flywheel's NeMo Gym is the `nemo-gym` package in its own venv, whose site-packages
hold the same tree (`resources_servers/...`). So such a path that does not exist from the working directory
is read from there. `policy.generation.vllm_cfg.expose_http_server` is a move to
`policy.generation.endpoint.enabled` (nemo_rl.py); env.nemo_gym's `invalid_tool_call_patterns` and `thinking_tags`,
which NeMo RL reads itself, are policy.generation's (rollout flags the turns).
"""

from __future__ import annotations

import os
from pathlib import Path

from services.common.config_loader import Problem

REPO = Path(__file__).resolve().parents[2]
GYM_CHECKOUT = "3rdparty/Gym-workspace/Gym/"
"""Where NeMo RL keeps NeMo Gym's source (a submodule); data paths in its configs start with it."""
GYM_DATASET = "NemoGymDataset"
GYM_SET_KEYS = {"dataset_name", "data_path", "env_name", "processor", "prompt_file", "system_prompt_file",
                "repeat"}
"""What NeMo RL's NemoGymDataset reads (prompt files and a repeat other than 1 are refused below)."""


def gym_venv() -> Path:
    """The NeMo Gym venv: FLYWHEEL_GYM_VENV, else the repository's `.venv-gym` (`make gym-venv`)."""
    return Path(os.environ.get("FLYWHEEL_GYM_VENV", REPO / ".venv-gym"))


def nemo_rl_agent_spec(nemo_gym: dict) -> dict:
    """NeMo RL's `env.nemo_gym` (its initial NeMo Gym global config) as a `nemo_gym` agent spec:
    `config_paths`, and the rest as NeMo Gym overrides, less the key only NeMo RL reads."""
    overrides = {k: v for k, v in nemo_gym.items() if k not in ("config_paths", "is_trajectory_collection")}
    return {"type": "nemo_gym", "config_paths": list(nemo_gym["config_paths"]), "overrides": overrides}


def resolve_gym_path(path: str) -> str:
    """`path` as NeMo RL opens it (from the working directory), or, for a path into NeMo RL's Gym checkout that
    is not there, the same file in the nemo-gym package of the NeMo Gym venv."""
    if Path(path).exists() or not path.startswith(GYM_CHECKOUT):
        return path
    site = next(gym_venv().glob("lib/python3*/site-packages"), None)
    return str(site / path[len(GYM_CHECKOUT):]) if site is not None else path


def prepare(tree: dict, problems: list[Problem], notes: list[Problem]) -> None:
    """With env.should_use_nemo_gym: env.nemo_gym and data's NemoGymDataset sets become one agent environment.
    Changes `tree`; without the switch it leaves everything to the rules (false and null are accepted)."""
    env = tree.get("env") or {}
    if env.get("should_use_nemo_gym") is not True:
        return
    del env["should_use_nemo_gym"]
    gym = env.pop("nemo_gym", None)
    if not isinstance(gym, dict) or not gym.get("config_paths"):
        problems.append(("env.nemo_gym.config_paths", "should_use_nemo_gym needs NeMo Gym's config paths "
                                                      "(vllm_model_for_training first)"))
        return
    if gym.get("is_trajectory_collection"):
        problems.append(("env.nemo_gym.is_trajectory_collection", "Flywheel cannot honour True: to collect "
                         "NeMo Gym rollouts without training, run `flywheel collect` with this config"))
    _flaw_markers(tree, gym, notes)
    data = tree.setdefault("data", {})
    train = _take_gym_sets(data, "train", problems)
    validation = _take_gym_sets(data, "validation", problems)
    if isinstance(data.get("default"), dict) and data["default"].get("dataset_name") == GYM_DATASET:
        del data["default"]
    if len(train) != 1:
        problems.append(("data.train", f"should_use_nemo_gym needs one NemoGymDataset in data.train (the agent "
                                       f"environment's dataset), found {len(train)}"))
        return
    (key, entry), = train
    if not isinstance(entry.get("data_path"), str):
        problems.append((f"{key}.data_path", "a NemoGymDataset needs data_path: a jsonl of NeMo Gym rows"))
        return
    name = entry.get("env_name") or "nemo_gym"
    spec = {"name": name, "kind": "agent", "dataset": resolve_gym_path(entry["data_path"]),
            "agent": nemo_rl_agent_spec(gym)}
    tree["environments"] = [*(tree.get("environments") or []), spec]
    _validate_on(data, name, validation, problems, notes)
    notes.append(("env.nemo_gym", f"read as the agent environment {name!r} (type nemo_gym): ng_run starts its "
                                  "servers from the NeMo Gym venv, its model server pointed at rollout's endpoint"))
    notes.append((key, f"read as environment {name!r}'s dataset: {spec['dataset']}"))


FLAW_MARKERS = ("invalid_tool_call_patterns", "thinking_tags")
"""env.nemo_gym keys NeMo RL reads itself, to flag a turn's flaws, which rollout does here."""


def _flaw_markers(tree: dict, gym: dict, notes: list[Problem]) -> None:
    """env.nemo_gym's flaw markers -> policy.generation's: rollout flags turns (NeMo RL's bridge flags NeMo Gym's
    output items); null or empty, NeMo RL's defaults, which are policy.generation's."""
    for key in FLAW_MARKERS:
        value = gym.pop(key, None)
        if value:
            tree.setdefault("policy", {}).setdefault("generation", {})[key] = value
            notes.append((f"env.nemo_gym.{key}", f"read as policy.generation.{key}: rollout flags each turn"))


def _validate_on(data: dict, name: str, sets: list[tuple[str, dict]], problems: list[Problem],
                 notes: list[Problem]) -> None:
    """data.validation's NemoGymDatasets as validation sets of the agent environment `name` (docs/agents.md,
    "Validation, `flywheel eval` and `flywheel collect`"), after the sets of other kinds kept there."""
    kept = data.get("validation")
    sets_out = kept if isinstance(kept, list) else [] if kept is None else [kept]
    for key, entry in sets:
        if entry.get("env_name", name) != name or not isinstance(entry.get("data_path"), str):
            problems.append((key, f"a NemoGymDataset validates the agent environment {name!r}: give data_path "
                                  f"and no other env_name"))
            continue
        sets_out.append({"data_path": resolve_gym_path(entry["data_path"]), "env_name": name})
        notes.append((key, f"read as validation prompts of {name!r}: {sets_out[-1]['data_path']}"))
    if sets:
        data["validation"] = sets_out[0] if len(sets_out) == 1 else sets_out


def _take_gym_sets(data: dict, key: str, problems: list[Problem]) -> list[tuple[str, dict]]:
    """data.<key>'s NemoGymDataset entries (data.default merged in, as NeMo RL does), removed from `data`."""
    given = data.get(key)
    entries = given if isinstance(given, list) else [] if given is None else [given]
    default = data.get("default") if isinstance(data.get("default"), dict) else {}
    taken, kept = [], []
    for i, entry in enumerate(entries):
        merged = {**default, **{k: v for k, v in (entry or {}).items() if v is not None}}
        where = key if len(entries) == 1 else f"{key}.{i}"
        if merged.get("dataset_name") != GYM_DATASET:
            kept.append(entry)
            continue
        taken.append((f"data.{where}", merged))
        for field in sorted(set(merged) - GYM_SET_KEYS):
            problems.append((f"data.{where}.{field}", "unknown key for a NemoGymDataset"))
        if merged.get("prompt_file") or merged.get("system_prompt_file") or merged.get("repeat", 1) != 1:
            problems.append((f"data.{where}", "Flywheel cannot honour prompt_file, system_prompt_file or repeat on "
                                              "a NemoGymDataset: its rows go to NeMo Gym as they are"))
    data[key] = kept if isinstance(given, list) else (kept[0] if kept else None)
    return taken
