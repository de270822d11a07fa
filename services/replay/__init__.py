"""Replay: stores finished trajectory groups in Redis and serves one reproducible batch per step.

store.py (Redis + Lua, no network protocols), validate.py (pure checks), ingest.py (NATS
consumer), server.py (gRPC servicer), main.py (serve). Never imports torch.
"""
