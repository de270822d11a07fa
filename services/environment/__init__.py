"""The environment service: scores episodes and drives multi-turn games (built-ins and remote proxies)."""
