"""Compose a config tree the way NeMo RL does: OmegaConf, `defaults:` inheritance, `${...}`, overrides.

    file.yaml ──defaults: chain (depth first, later wins, `_override_: true` replaces a section)──▶ tree
    tree ──overrides (key=value, +key=value, ++key=value, ~key)──▶ tree ──resolve ${...}──▶ plain dict

The semantics are NeMo RL's `nemo_rl/utils/config.py` (load_config_with_inheritance, its
mul/add/div/max resolvers, Hydra's override prefixes), so one of its configs composes here to
the same tree. Nothing stops at the first problem: every bad override or interpolation is
collected as (dotted key, message), so a user fixes them all in one go. No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import omegaconf
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

Problem = tuple[str, str]
_V24 = tuple(int(x) for x in omegaconf.__version__.split(".")[:2]) >= (2, 4)
"""(dotted key or file, what is wrong)."""


class ComposeError(ValueError):
    """A file that cannot be read or parsed at all; nothing else can be checked after it."""


def _register_resolvers() -> None:
    for name, fn in (("add", lambda a, b: a + b), ("mul", lambda a, b: a * b),
                     ("div", lambda a, b: a / b), ("max", lambda a, b: max(a, b))):
        if not OmegaConf.has_resolver(name):
            # 2.4 renamed register_new_resolver (2.1-2.3) to register_resolver; both take (name, fn).
            getattr(OmegaConf, "register_resolver" if _V24 else "register_new_resolver")(name, fn)


def _load_file(path: Path) -> DictConfig:
    if not path.is_file():
        raise ComposeError(f"{path}: no such config file")
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise ComposeError(f"{path}: not valid YAML: {err}".replace("\n", " ")) from None
    if not isinstance(cfg, DictConfig):
        raise ComposeError(f"{path}: the top level must be a mapping")
    return cfg


def _merge(base: DictConfig, child: DictConfig) -> DictConfig:
    """OmegaConf.merge, except a child section marked `_override_: true` replaces the base's whole."""
    for key in list(child.keys()):
        if OmegaConf.is_missing(child, key):
            continue
        node = child[key]
        if isinstance(node, DictConfig) and node.get("_override_", False):
            node.pop("_override_")
            if key in base:
                base.pop(key)
    return OmegaConf.merge(base, child)


def compose(path: str | Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    """The file merged over its `defaults:` (a path or a list, relative to the file), recursively."""
    path = Path(path).resolve()
    if path in seen:
        raise ComposeError(f"{path}: defaults: inheritance loops back to this file")
    cfg = _load_file(path)
    if "defaults" not in cfg:
        return cfg
    parents = cfg.pop("defaults")
    parents = [parents] if isinstance(parents, str) else list(parents or [])
    base = OmegaConf.create({})
    for parent in parents:
        parent_path = Path(str(parent))
        parent_path = parent_path if parent_path.is_absolute() else path.parent / parent_path
        try:
            base = _merge(base, compose(parent_path, (*seen, path)))
        except ComposeError as err:
            raise ComposeError(f"{path}: defaults: {parent}: {err}") from None
    return _merge(base, cfg)


def split_override(text: str) -> tuple[str, str, Any]:
    """`++a.b=3` -> ("++", "a.b", 3). The value is read as YAML; `${...}` stays for the resolver."""
    prefix = next((p for p in ("++", "+", "~") if text.startswith(p)), "")
    body = text[len(prefix):]
    key, sep, raw = body.partition("=")
    key = key.strip()
    if not key or (prefix != "~" and not sep):
        raise ValueError(f"override {text!r} is not key=value (or +key=value, ++key=value, ~key)")
    try:
        value = yaml.safe_load(raw) if sep else None
    except yaml.YAMLError:
        raise ValueError(f"override {text!r}: the value is not valid YAML") from None
    return prefix, key, value


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> list[Problem]:
    """Hydra's prefixes: `key=v` sets, `+key=v` adds a key that must be new, `++key=v` sets or adds, `~key` deletes."""
    problems: list[Problem] = []
    for text in overrides:
        try:
            prefix, key, value = split_override(text)
        except ValueError as err:
            problems.append((text, str(err)))
            continue
        exists = OmegaConf.select(cfg, key, default="__absent__", throw_on_resolution_failure=False) != "__absent__"
        if prefix == "+" and exists:
            problems.append((key, f"+{key}=... adds a key, but it is already set; use {key}=... or ++{key}=..."))
        elif prefix == "~":
            if exists:
                _delete(cfg, key)
        else:
            try:
                OmegaConf.update(cfg, key, value, merge=False, force_add=True)
            except OmegaConfBaseException as err:
                problems.append((key, f"cannot set: {err.msg if hasattr(err, 'msg') else err}"))
    return problems


def _delete(cfg: DictConfig, key: str) -> None:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if isinstance(parent, DictConfig):
        parent.pop(leaf)


def resolve(cfg: DictConfig) -> tuple[dict, list[Problem]]:
    """A plain dict with every `${...}` resolved; a key whose interpolation fails is reported and left out."""
    _register_resolvers()
    problems: list[Problem] = []
    return _resolve_node(cfg, "", problems), problems


def _resolve_node(node: DictConfig | ListConfig, prefix: str, problems: list[Problem]) -> Any:
    items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else enumerate(node._iter_ex(resolve=False))
    out: dict | list = {} if isinstance(node, DictConfig) else []
    for key, _ in items:
        dotted = f"{prefix}{key}"
        try:
            child = node[key]
        except OmegaConfBaseException as err:
            problems.append((dotted, f"cannot resolve: {_first_line(err)}"))
            continue
        if isinstance(child, (DictConfig, ListConfig)):
            child = _resolve_node(child, f"{dotted}.", problems)
        if isinstance(out, dict):
            out[str(key)] = child
        else:
            out.append(child)
    return out


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def compose_tree(path: str | Path | None, overrides: list[str],
                 base: dict | None = None) -> tuple[dict, list[Problem]]:
    """File (or `base` when there is none) + overrides -> (resolved plain tree, problems)."""
    cfg = compose(path) if path else OmegaConf.create(base or {})
    problems = apply_overrides(cfg, list(overrides))
    tree, unresolved = resolve(cfg)
    return tree, problems + unresolved
