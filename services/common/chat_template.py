"""The chat-template rule, checked where it can be: at config time (`flywheel config check`, `flywheel up`)
when the tokenizer is on disk, and again in every process that loads the tokenizer.

`policy.tokenizer.chat_template: default` means the tokenizer's own template. A base model's tokenizer often
has none, and transformers then refuses every `apply_chat_template` call: without this check each group
fails in rollout, is handed back and fails again, and the run never trains. Imports no torch.
"""

from __future__ import annotations

from services.common.config import PolicyConfig
from services.common.config_base import ConfigError


def require_chat_template(tokenizer, name: str, key: str = "policy.tokenizer") -> None:
    """ConfigError naming the fix when the configured template is the tokenizer's own and it has none;
    `name`: where the tokenizer came from, `key`: the config section that chose its template."""
    if getattr(tokenizer, "chat_template", None):
        return
    raise ConfigError(
        f"{key}.chat_template: the tokenizer of {name!r} has no chat template, and 'default' asks for its own. "
        f"Set {key}.chat_template=null to join the messages' text (base models; NeMo RL's passthrough), "
        "or give a Jinja template or a .jinja file")


def check_chat_template(cfg: PolicyConfig) -> None:
    """At config time: load the tokenizer if it is on this disk (a local path or the Hugging Face cache) and
    apply the rule. One that is not on disk yet is left to the services, which check it as they load it."""
    if cfg.model_name == "tiny" or (cfg.tokenizer.chat_template or "").lower() != "default":
        return
    try:
        from transformers import AutoTokenizer
    except ImportError:  # a slim install (controller, replay, environment) has no tokenizers
        return
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_name, local_files_only=True)
    except (OSError, ValueError):
        return
    require_chat_template(tokenizer, cfg.tokenizer_name)
