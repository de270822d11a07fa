"""The base of every config section and the error a bad config raises (no torch, no IO)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config that cannot be used; one line per problem, each naming its dotted key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
