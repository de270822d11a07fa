"""Two `flywheel up` runs on one host take disjoint ports (issue 36, gap 4): the launcher fills in every address
with a free port and leaves the trainer's weight-sync store on port 0 (the kernel picks it when the trainer binds)."""

from services.common.config import ServiceAddresses, load_config
from services.local import LocalStack


def _ports(stack: LocalStack) -> set[int]:
    a = stack.cfg.addresses
    services = [a.controller, a.environment, a.replay, a.rollout, a.trainer, a.reward_model]
    return {stack.nats.port, stack.redis.port, *(int(s.rpartition(":")[2]) for s in services)}


def test_two_launchers_on_one_host_share_no_port_and_none_is_a_default(tmp_path):
    cfg = load_config(None, [])
    with LocalStack(cfg, tmp_path / "a") as a, LocalStack(cfg, tmp_path / "b") as b:
        first, second = _ports(a), _ports(b)
        assert len(first) == len(second) == 8
        assert not first & second
        defaults = ServiceAddresses()
        fixed = {4222, 6379, *(int(getattr(defaults, s).rpartition(":")[2]) for s in
                                ("controller", "environment", "replay", "rollout", "trainer", "reward_model"))}
        assert not (first | second) & fixed
        assert a.cfg.weight_sync.store_port == b.cfg.weight_sync.store_port == 0
