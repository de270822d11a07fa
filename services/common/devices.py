"""Which GPUs each service process gets, and the device combinations that cannot work.

    config (trainer ranks, rollout workers x vLLM TP, reward model) + the host's GPUs
        ──plan──▶ process name -> device ids ──▶ CUDA_VISIBLE_DEVICES of each child (services/local.py)

A process sees only its own devices, so its `cuda:0` is the first of them: trainer rank r takes the r-th
of the trainer's (services/trainer/distributed.py), a vLLM engine its TP ranks' in order. Placement:
the trainer's ranks first, each on its own device (NCCL refuses two ranks of one communicator on one
device); then rollout workers (vLLM: tensor_parallel_size devices each), the reward-model server and a
distillation run's teacher servers on the devices after the trainer's, wrapping round when there are fewer than they ask for, so workers then share.
Where nothing is left after the trainer (one GPU), rollout time-shares the trainer's devices.

What cannot work is refused with the alternative named (`problems`), each under a dotted key, as config
errors are. No torch here: the controller-side CLI imports it. Nothing in this module has run on a GPU
machine; the rules come from NCCL's and vLLM's documented behaviour (cited where applied).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.common.config_base import ConfigError

if TYPE_CHECKING:
    from services.common.config import FlywheelConfig

Problem = tuple[str, str]
"""(dotted key, message), as services/common/config_loader.py reports them."""

TIME_SHARING_BACKENDS = ("gloo", "filesystem")
"""Weight backends that work between two processes on one device: gloo stages through host memory
(backends/collective.py), filesystem writes a file. NIXL could too (UCX cuda_ipc) but is untried here."""


@dataclass(frozen=True, slots=True)
class Demand:
    """The GPU processes a config asks for on one host."""

    trainer_ranks: int
    """trainer.nproc_per_node: one device each; 0 when the trainer computes on CPU (trainer.device)."""
    rollout_workers: int
    rollout_gpus: int
    """Devices per rollout worker: vLLM's tensor_parallel_size; 0 for the hf engine, which samples on CPU."""
    vllm_memory: float
    """policy.generation.vllm_cfg.gpu_memory_utilization: the fraction of each of its devices a vLLM worker takes."""
    reward_model: bool
    """env.reward_model's server runs here (one device)."""
    nccl: bool
    """weight_sync.backend is nccl: trainer rank 0 and each worker's first device form one NCCL communicator."""
    teachers: int = 0
    """Teacher servers of a distillation run started here (teacher.num_replicas; one device each)."""


def demand_of(cfg: FlywheelConfig) -> Demand:
    gen = cfg.policy.generation
    vllm = gen.backend == "vllm"
    on_gpu = cfg.trainer.device == "cuda" or cfg.policy.megatron_cfg.enabled  # trainer_device's rule
    return Demand(trainer_ranks=cfg.trainer.nproc_per_node if on_gpu else 0, rollout_workers=cfg.rollout.num_workers,
                  rollout_gpus=gen.vllm_cfg.tensor_parallel_size if vllm else 0,
                  vllm_memory=gen.vllm_cfg.gpu_memory_utilization if vllm else 0.0,
                  reward_model=cfg.uses_reward_model, nccl=cfg.weight_sync.backend == "nccl", teachers=launched_teachers(cfg))


def launched_teachers(cfg: FlywheelConfig) -> int:
    """Teacher servers a launcher starts: teacher.num_replicas, none when teacher.addresses names the servers."""
    return cfg.teacher.num_replicas if cfg.uses_teacher and not cfg.teacher.addresses else 0


@dataclass(frozen=True, slots=True)
class Plan:
    gpus: tuple[str, ...]
    """The host's devices as CUDA names them (indices, or GPU-/MIG- UUIDs); empty: a CPU host."""
    devices: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Process name (trainer, rollout-<i>, reward_model) -> its devices; only processes that use a GPU."""

    def visible(self, name: str) -> str | None:
        """CUDA_VISIBLE_DEVICES for process `name`: its devices; "" hides every GPU from a process that samples
        on CPU (the hf engine) so it holds no context on another's device; None: leave the environment as it
        is (a CPU host, or a service that never imports torch)."""
        if not self.gpus:
            return None
        if name in self.devices:
            return ",".join(self.devices[name])
        return "" if name == "trainer" or name.startswith("rollout-") else None

    def sharing(self) -> dict[str, list[str]]:
        """Device -> the processes placed on it, for the devices that hold more than one."""
        on: dict[str, list[str]] = {}
        for name, devs in self.devices.items():
            for d in devs:
                on.setdefault(d, []).append(name)
        return {d: names for d, names in on.items() if len(names) > 1}

    def rollout_shares_the_trainers(self) -> bool:
        """A rollout worker is on one of the trainer's devices (one GPU: they time-share it)."""
        trainer = set(self.devices.get("trainer", ()))
        return any(trainer & set(devs) for name, devs in self.devices.items() if name.startswith("rollout-"))

    def describe(self) -> str:
        if not self.gpus:
            return "devices: no GPU on this host: every service runs on CPU"
        placed = "; ".join(f"{n} GPU {','.join(d)}" for n, d in self.devices.items())
        shared = "".join(f" [{d} shared by {', '.join(n)}]" for d, n in self.sharing().items())
        cpu = "" if "trainer" in self.devices else " (the trainer computes on CPU: set trainer.device=cuda for a GPU)"
        return f"devices on {len(self.gpus)} GPU(s): {placed or 'none used'}{shared}{cpu}"


def plan(demand: Demand, gpus: list[str] | tuple[str, ...]) -> Plan:
    """Place the processes of `demand` on `gpus` (see the module docstring); `problems` says what cannot run."""
    gpus = tuple(gpus)
    if not gpus:
        return Plan(gpus=gpus)
    devices: dict[str, tuple[str, ...]] = {}
    trainer = gpus[:demand.trainer_ranks]
    if trainer:
        devices["trainer"] = trainer
    rest = gpus[len(trainer):]
    pool = rest if len(rest) >= max(demand.rollout_gpus, 1) else gpus
    slot = 0
    for i in range(demand.rollout_workers if demand.rollout_gpus else 0):
        devices[f"rollout-{i}"] = tuple(pool[(slot + j) % len(pool)] for j in range(demand.rollout_gpus))
        slot += demand.rollout_gpus
    if demand.reward_model:
        devices["reward_model"] = (pool[slot % len(pool)],)
        slot += 1
    for i in range(demand.teachers):
        devices[f"teacher-{i}"] = (pool[(slot + i) % len(pool)],)
    return Plan(gpus=gpus, devices=devices)


def problems(cfg: FlywheelConfig, gpus: list[str] | tuple[str, ...]) -> list[Problem]:
    """What cannot run on a host with `gpus`, each with the alternative named (config_problems aside, which
    config.load reports)."""
    d = demand_of(cfg)
    return capacity_problems(d, gpus) or placement_problems(d, plan(d, gpus))


def capacity_problems(d: Demand, gpus: list[str] | tuple[str, ...]) -> list[Problem]:
    """Processes that need more devices of their own than the host has, or GPUs where there are none."""
    if not gpus:
        return [("weight_sync.backend", "nccl needs GPUs and this host has none (CUDA_VISIBLE_DEVICES, "
                 "nvidia-smi); use gloo, which runs on CPU")] if d.nccl else []
    if d.trainer_ranks > len(gpus):
        return [("trainer.nproc_per_node", f"{d.trainer_ranks} ranks need a GPU each (NCCL refuses two ranks on "
                 f"one device) and this host has {len(gpus)}; set trainer.nproc_per_node <= {len(gpus)}")]
    if d.rollout_gpus > len(gpus):
        return [("policy.generation.vllm_cfg.tensor_parallel_size", f"{d.rollout_gpus} needs a GPU per TP rank "
                 f"and this host has {len(gpus)}; set it <= {len(gpus)}")]
    return []


def placement_problems(d: Demand, p: Plan) -> list[Problem]:
    """What cannot run where `p` puts the processes: vLLM's memory on a shared device, NCCL on a shared device."""
    return _memory_problems(d, p) + (_nccl_problems(p) if d.nccl and p.gpus else [])


def config_problems(cfg: FlywheelConfig) -> list[Problem]:
    """What cannot work on any host: config.load reports these with the schema's errors."""
    if cfg.weight_sync.backend != "nccl":
        return []
    if cfg.policy.generation.backend == "hf":
        return [("weight_sync.backend", "nccl moves CUDA tensors, and the hf engine samples on CPU "
                 "(services/rollout/engines/hf.py); use gloo or filesystem, or policy.generation.backend=vllm")]
    if cfg.trainer.device != "cuda" and not cfg.policy.megatron_cfg.enabled:
        return [("weight_sync.backend", "nccl moves CUDA tensors, and the trainer computes on CPU "
                 "(trainer.device=cpu); set trainer.device=cuda, or use gloo or filesystem")]
    return []


def _memory_problems(d: Demand, p: Plan) -> list[Problem]:
    """vLLM takes gpu_memory_utilization x the device's memory at start and refuses to start when that much is
    not free (vllm/v1/worker/utils.py, request_memory); beside another process it must leave that one room."""
    for dev, names in p.sharing().items():
        engines = [n for n in names if n.startswith("rollout-")]
        share = d.vllm_memory * len(engines)
        if engines and share >= 1:
            return [("policy.generation.vllm_cfg.gpu_memory_utilization",
                     f"GPU {dev} holds {', '.join(names)}: {len(engines)} x {d.vllm_memory:g} of its memory for "
                     f"vLLM leaves nothing for the rest; lower it (e.g. {0.9 / len(names):.2f}), run fewer "
                     f"rollout workers, or give them GPUs of their own")]
    return []


def _nccl_problems(p: Plan) -> list[Problem]:
    """The weight channel's NCCL communicator holds trainer rank 0 and each rollout worker's first device; NCCL
    refuses a communicator with two ranks on one device."""
    if "trainer" not in p.devices:
        return []  # a CPU trainer: config_problems refuses nccl for it on any host
    members = [("trainer", p.devices["trainer"][0])]
    members += [(n, devs[0]) for n, devs in p.devices.items() if n.startswith("rollout-")]
    seen: dict[str, str] = {}
    for name, dev in members:
        if dev in seen:
            return [("weight_sync.backend", f"nccl between processes that share a device: {seen[dev]} and {name} "
                     f"are both on GPU {dev}, and NCCL refuses two ranks of one communicator on one device; use "
                     f"gloo (it stages through host memory) or filesystem, or give every process its own GPU")]
        seen[dev] = name
    return []


def host_gpus(env: dict[str, str] | None = None) -> list[str]:
    """This host's GPUs as CUDA names them: CUDA_VISIBLE_DEVICES when set (taken as it is, so it also says what
    a check should plan for), else `nvidia-smi -L`'s GPUs; none without either."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return visible_list(env["CUDA_VISIBLE_DEVICES"])
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def visible_list(value: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES -> device names. CUDA stops at the first invalid entry and reads -1 as none."""
    out = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return out


def checked_plan(cfg: FlywheelConfig, gpus: list[str] | None = None) -> Plan:
    """The plan for this host's GPUs (or `gpus`); raises ConfigError listing every problem. `flywheel config
    check` and `flywheel up` call it before anything starts."""
    from services.common.config import format_problems  # config imports this module

    gpus = host_gpus() if gpus is None else gpus
    found = problems(cfg, gpus)
    if found:
        where = f"this host's {len(gpus)} GPU(s)" if gpus else "this host (no GPU)"
        raise ConfigError(format_problems(found) + f"\n(checked against {where}; CUDA_VISIBLE_DEVICES=0,1,... "
                          "checks for another machine's)")
    return plan(demand_of(cfg), gpus)


def device_env(p: Plan, name: str, parent: dict[str, str] | None = None) -> dict[str, str]:
    """The variables process `name` gets on top of the launcher's environment: its CUDA_VISIBLE_DEVICES, and
    CUDA_DEVICE_ORDER=PCI_BUS_ID where the indices came from nvidia-smi (which numbers by PCI bus; CUDA's own
    default order, fastest first, can differ on a mixed host). Empty on a CPU host: the run is unchanged."""
    parent = os.environ if parent is None else parent
    visible = p.visible(name)
    if visible is None:
        return {}
    env = {"CUDA_VISIBLE_DEVICES": visible}
    if "CUDA_VISIBLE_DEVICES" not in parent and "CUDA_DEVICE_ORDER" not in parent:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env
