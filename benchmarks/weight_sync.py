"""Weight-channel throughput against its ceilings, with receivers in separate processes.

For each backend, payload size, receiver count and layout of the state dict it prints:
  channel   WeightSender.sync end to end (handshake, transfer, checksums, acks), GB/s per receiver; a line
            below gives the best sync's phases (announce, join, send, confirm: the sender's ms in each)
  raw       one flat tensor of the same size moved by the same transport with no channel logic (gloo: one
            broadcast on a bare, already connected ProcessGroupGloo after an untimed first one, as the
            channel reuses its group, timed until a one-float allreduce says every receiver has it; nixl:
            register + one READ of one buffer): the transport's ceiling
  split     gloo only: the same flat bytes broadcast in the pieces the channel's plan sends for this layout
            (one per bucket, at most two in flight, as the channel does): the transport's ceiling for that
            many transfers, since each gloo broadcast has a fixed cost
  memcpy    torch copy_ of the same bytes in one process: the machine's ceiling
and the ratios channel/raw, channel/split and channel/memcpy. GB = 1e9 bytes. Each figure is the best of `--repeat` runs
after one warm-up. Layouts (float32):
  decoder      the tensor mix of a real decoder (hidden 512 or 1024, GQA, MLP 2.75x, biases and norms,
               ~20% of bytes in embeddings): tensors of 2 KiB to 100 MB, 3-4% of bytes packed
  small-heavy  a pessimistic mix: 10% of bytes in 64 KiB tensors (all packed), the rest in 8 MiB ones
  flat         one tensor: the channel's own cost, without any layout's
    python benchmarks/weight_sync.py --backends gloo,nixl --sizes 100 --receivers 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = ("decoder", "small-heavy", "flat")


def state_for(layout: str, total_bytes: int):
    """A state dict of about `total_bytes` float32 bytes in the given layout (see the module docstring)."""
    import torch

    floats = total_bytes // 4
    shapes: dict[str, tuple[int, ...]] = {}
    if layout == "flat":
        shapes["flat"] = (floats,)
    elif layout == "small-heavy":
        small, large = (64 << 10) // 4, (8 << 20) // 4
        n_small = floats // 10 // small
        shapes.update({f"norm.{i}": (small,) for i in range(n_small)})
        rest, j = floats - n_small * small, 0
        while rest > 0:
            shapes[f"linear.{j}"] = (min(large, rest),)
            rest -= large
            j += 1
    elif layout == "decoder":
        h = 512 if total_bytes < 500_000_000 else 1024  # at least 7 layers at every size
        kv, mlp = h // 4, h * 11 // 4
        vocab = max(1, floats // 10 // h)  # input embedding + untied head: ~20% of the bytes
        shapes["embed_tokens.weight"] = (vocab, h)
        layer = {
            "input_layernorm.weight": (h,), "self_attn.q_proj.weight": (h, h), "self_attn.q_proj.bias": (h,),
            "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
            "self_attn.o_proj.weight": (h, h), "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (mlp, h), "mlp.up_proj.weight": (mlp, h), "mlp.down_proj.weight": (h, mlp),
        }
        per_layer = sum(_numel(s) for s in layer.values())
        for i in range(max(1, (floats - 2 * vocab * h) // per_layer)):
            shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
        shapes["norm.weight"] = (h,)
        shapes["lm_head.weight"] = (vocab, h)
    else:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- receiver process ------------------------------------------------------------------------------------


def receiver_main(a: argparse.Namespace) -> None:
    import torch

    from torch.distributed import PrefixStore

    from services.common.weights import WeightReceiver, poll_announcement
    from services.common.weights.rendezvous import Deadline, connect_store, wait_key

    store = connect_store(a.store, Deadline(30))
    receiver = WeightReceiver(a.worker_id, a.backend, host="127.0.0.1")
    into = {layout: {k: torch.empty_like(v) for k, v in state_for(layout, a.bytes).items()} for layout in a.layouts}
    flat = torch.empty(a.bytes, dtype=torch.uint8)
    after, k = (0, 0), 0
    print(json.dumps({"event": "ready"}), flush=True)
    while True:
        k += 1
        cmd = json.loads(wait_key(store, f"bench/cmd/{k}", Deadline(600), "a bench command"))
        if cmd["op"] == "exit":
            return
        if cmd["op"] == "sync":
            ann = poll_announcement(a.store, newer_than=after, timeout_s=120)
            after = ann.order
            receiver.receive(ann, into[cmd["layout"]], timeout_s=120)
        elif cmd["op"] == "raw":
            raw_receive(a.backend, store, cmd, a.rank, flat)
        elif cmd["op"] == "split":
            pg = _gloo(PrefixStore(cmd["prefix"], store), a.rank, cmd["world"])
            for _ in range(cmd["times"]):
                _gloo_transfer(pg, flat, cmd["sizes"])


def raw_receive(backend: str, store, cmd: dict, rank: int, flat) -> None:
    from torch.distributed import PrefixStore

    prefix = PrefixStore(cmd["prefix"], store)
    if backend == "gloo":
        pg = _gloo(prefix, rank, cmd["world"])
        for _ in range(2):  # an untimed first transfer on the new connections, then the timed one
            _gloo_transfer(pg, flat)
        return
    _nixl_read(prefix, flat)
    prefix.set(f"done/{rank}", "1")


def _gloo_transfer(pg, flat, sizes: list[int] | None = None) -> None:
    """One raw transfer, run alike by sender and receivers: the broadcast (of `flat`, or of consecutive pieces
    of it of these sizes, at most two in flight), then a one-float allreduce that returns once every receiver
    has the bytes (the sender's clock stops there)."""
    import torch

    works, start, limit = [], 0, timedelta(seconds=120)
    for size in sizes or [flat.numel()]:
        works.append(pg.broadcast(flat[start:start + size], 0))
        start += size
        if len(works) > 2:
            works.pop(0).wait(limit)
    for work in works:
        work.wait(limit)
    pg.allreduce(torch.zeros(1)).wait(limit)


def _gloo(store, rank: int, world: int):
    from torch.distributed import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timedelta(seconds=120)
    return ProcessGroupGloo(store, rank, world, opts)


_AGENT = None


def _agent():
    global _AGENT
    if _AGENT is None:
        from nixl._api import nixl_agent, nixl_agent_config

        _AGENT = nixl_agent(f"bench-{os.getpid()}", nixl_agent_config(enable_prog_thread=False))
    return _AGENT


def _nixl_read(store, flat) -> None:
    from services.common.weights.rendezvous import Deadline, wait_key

    agent = _agent()
    peer = agent.add_remote_agent(wait_key(store, "agent", Deadline(60), "agent"))
    addr, length = json.loads(wait_key(store, "desc", Deadline(60), "desc"))
    reg = agent.register_memory([flat])
    handle = agent.initialize_xfer(
        "READ", agent.get_xfer_descs([flat]), agent.get_xfer_descs([(addr, length, 0)], "DRAM"), peer
    )
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    assert state == "DONE", state
    agent.release_xfer_handle(handle)
    agent.deregister_memory(reg)
    agent.remove_remote_agent(peer)


# -- driver ----------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, backend: str, nbytes: int, receivers: int, bucket_bytes: int, whole_bytes: int | None,
                 layouts: list[str]):
        from services.common.weights import WeightSender

        self.backend, self.nbytes, self.n = backend, nbytes, receivers
        self.sender = WeightSender(backend=backend, bucket_bytes=bucket_bytes, whole_bytes=whole_bytes)
        self.k = 0
        self.members = [f"r{i}" for i in range(receivers)]
        from services.common.infra import die_with_parent  # no receiver outlives a benchmark that was killed

        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.procs = []
        for i, w in enumerate(self.members):
            cmd = [sys.executable, __file__, "--role", "receiver", "--store", self.sender.store_address,
                   "--worker-id", w, "--rank", str(i + 1), "--bytes", str(nbytes), "--backends", backend,
                   "--layouts", ",".join(layouts)]
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=die_with_parent)
            for line in p.stdout:
                if line.startswith('{"event": "ready"'):
                    break
            self.procs.append(p)

    def command(self, op: str, **kw) -> None:
        self.k += 1
        self.sender.store.set(f"bench/cmd/{self.k}", json.dumps({"op": op, **kw}))

    def channel(self, state, version: int, layout: str) -> tuple[float, dict[str, float]]:
        """GB/s of one sync, and its phases (the sender's seconds in each)."""
        self.command("sync", layout=layout)
        r = self.sender.sync(version, self.members, state, timeout_s=300)
        assert r.members_ok == self.members, r
        return r.gbps, r.phases

    def raw(self, flat) -> float:
        from torch.distributed import PrefixStore

        from services.common.weights.rendezvous import Deadline, wait_keys

        prefix_name = f"bench/raw/{self.k + 1}"
        prefix = PrefixStore(prefix_name, self.sender.store)
        self.command("raw", prefix=prefix_name, world=self.n + 1)
        if self.backend == "gloo":
            # Neither connection setup nor the first transfer on the new connections is timed: the channel
            # reuses its group. The allreduce that ends each transfer costs less than polling the store.
            pg = _gloo(prefix, 0, self.n + 1)
            for _ in range(2):
                start = time.perf_counter()
                _gloo_transfer(pg, flat)
            return self.nbytes / (time.perf_counter() - start) / 1e9
        agent = _agent()
        start = time.perf_counter()
        reg = agent.register_memory([flat])
        prefix.set("agent", agent.get_agent_metadata())
        prefix.set("desc", json.dumps([flat.data_ptr(), flat.numel()]))
        done = set()
        while len(done) < self.n:  # the target progresses its worker while readers read (as the channel)
            agent.get_new_notifs()
            done = wait_keys(prefix, [f"done/{i + 1}" for i in range(self.n)], Deadline(0))
        seconds = time.perf_counter() - start
        agent.deregister_memory(reg)
        return self.nbytes / seconds / 1e9

    def split(self, flat, sizes: list[int], repeat: int) -> float:
        """gloo: the same bytes in the channel plan's pieces on one group, best of `repeat` after a warm-up."""
        from torch.distributed import PrefixStore

        prefix_name = f"bench/split/{self.k + 1}"
        self.command("split", prefix=prefix_name, world=self.n + 1, sizes=sizes, times=repeat + 1)
        pg = _gloo(PrefixStore(prefix_name, self.sender.store), 0, self.n + 1)
        _gloo_transfer(pg, flat, sizes)  # connections and first touch, untimed
        best = min(_timed(lambda: _gloo_transfer(pg, flat, sizes)) for _ in range(repeat))
        return sum(sizes) / best / 1e9

    def pieces(self, state) -> list[int]:
        """Bytes of each transfer the channel's plan makes for `state`."""
        from services.common.weights.manifest import Manifest, plan_buckets

        return [b.nbytes for b in plan_buckets(Manifest.of(state), self.sender.bucket_bytes, self.sender.whole_bytes)]

    def close(self) -> None:
        self.command("exit")
        for p in self.procs:
            p.wait(timeout=60)
        self.sender.close()


def memcpy_gbps(nbytes: int, repeat: int) -> float:
    import torch

    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeat))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(a: argparse.Namespace) -> None:
    import torch

    print(f"{'backend':<8} {'size':>6} {'recv':>4} {'layout':<12} {'tensors':>7} {'channel GB/s':>13} "
          f"{'raw GB/s':>9} {'split GB/s':>11} {'memcpy GB/s':>12} {'chan/raw':>9} {'chan/split':>11} "
          f"{'chan/memcpy':>12}", flush=True)
    for mb in a.sizes:
        nbytes = mb * 1_000_000 // 4 * 4
        states = {layout: state_for(layout, nbytes) for layout in a.layouts}
        flat = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        mem = memcpy_gbps(nbytes, a.repeat)
        for backend in a.backends:
            for n in a.receivers:
                bench = Bench(backend, nbytes, n, a.bucket_mb << 20, (a.whole_kb << 10) or None, a.layouts)
                try:
                    chan, phases, version = {}, {}, 0
                    for layout, state in states.items():
                        # The first sync of each layout is a warm-up: first epoch, page faults in new buffers.
                        for v in range(a.repeat + 1):
                            version += 1
                            gbps, took = bench.channel(state, version, layout)
                            if v and gbps > chan.get(layout, 0.0):
                                chan[layout], phases[layout] = gbps, took
                    bench.raw(flat)
                    raw = max(bench.raw(flat) for _ in range(a.repeat))
                    split = {layout: bench.split(flat, bench.pieces(state), a.repeat)
                             for layout, state in states.items()} if backend == "gloo" else {}
                finally:
                    bench.close()
                for layout, gbps in chan.items():
                    cut = f"{split[layout]:>11.2f}" if layout in split else f"{'-':>11}"
                    cut_ratio = f"{gbps / split[layout]:>11.2f}" if layout in split else f"{'-':>11}"
                    print(f"{backend:<8} {mb:>4}MB {n:>4} {layout:<12} {len(states[layout]):>7} {gbps:>13.2f} "
                          f"{raw:>9.2f} {cut} {mem:>12.2f} {gbps / raw:>9.2f} {cut_ratio} {gbps / mem:>12.2f}",
                          flush=True)
                    print("         that sync's phases, ms: " + ", ".join(
                        f"{phase} {seconds * 1e3:.1f}" for phase, seconds in phases[layout].items()), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="gloo,nixl", help="comma list: gloo,nixl")
    p.add_argument("--sizes", default="100,1000", help="payload sizes in MB (1e6 bytes), comma list")
    p.add_argument("--receivers", default="1,2", help="receiver counts, comma list")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--bucket-mb", type=int, default=64, help="channel bucket size in MiB")
    p.add_argument("--whole-kb", type=int, default=0,
                   help="tensors of at least this many KiB go whole, smaller ones are packed (0: the backend's)")
    p.add_argument("--repeat", type=int, default=3, help="measured runs per figure (best is shown)")
    p.add_argument("--role", default="driver", choices=["driver", "receiver"], help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--worker-id", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    sys.path.insert(0, str(REPO))
    a.layouts = a.layouts.split(",")
    if a.role == "receiver":
        a.backend = a.backends
        receiver_main(a)
        return
    a.backends = a.backends.split(",")
    a.sizes = [int(x) for x in a.sizes.split(",")]
    a.receivers = [int(x) for x in a.receivers.split(",")]
    run(a)


if __name__ == "__main__":
    main()
