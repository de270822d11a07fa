"""The FSDP2 backend: torch `fully_shard` over the data-parallel ranks, gloo on CPU, NCCL on GPU.

Every rank holds the whole step's batch and runs the rows services/trainer/plan.py gives
it. Each micro-batch loss is divided by the optimizer step's GLOBAL valid tokens (or
sequences), so summed micro-batch gradients are the step-wide mean for any micro-batching
and any number of ranks. FSDP averages gradients over ranks; the loss is multiplied by
the world size to undo that, so ranks effectively sum (NeMo RL does the same).

Master weights are fp32. On GPU with precision bfloat16 the forward and backward run in
bf16 (MixedPrecisionPolicy) with fp32 gradient reduction; on CPU everything is fp32, and
weights are cast to the configured precision only when they are published.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from services.common.config import FlywheelConfig
from services.common.modeling import load_policy
from services.trainer.algorithms import LossInputs, clipped_pg_loss
from services.trainer.algorithms.metrics import combine_metrics, reduction
from services.trainer.backends import TrainingBackend
from services.trainer.backends.context_parallel import use_context_parallel_attention
from services.trainer.backends.distill_step import distill_step
from services.trainer.backends.expert_parallel import shard_experts
from services.trainer.backends.forward import Forward
from services.trainer.backends.full_weights import full_weights
from services.trainer.backends.offline_step import offline_step, offline_validate
from services.trainer.backends.reward_head import load_scorer
from services.trainer.backends.tensor_parallel import grad_allreduce_params, sum_over_tp, tensor_parallel
from services.trainer.batch import TrainBatch, mask_batch_by_sequence_error
from services.trainer.distributed import RankInfo
from services.trainer.lora import adapters_off, apply_lora
from services.trainer.optim import build_optimizer, build_scheduler, state_in_host_memory
from services.trainer.plan import logprob_plan, optimizer_steps, train_plan

log = logging.getLogger("flywheel.trainer")


class FSDP2Backend(TrainingBackend):
    def __init__(self, cfg: FlywheelConfig, info: RankInfo) -> None:
        self.cfg = cfg
        self.rank, self.world = info.rank, info.world
        self.tp, self.cp = cfg.policy.tensor_parallel_size, cfg.policy.context_parallel_size  # one of them is 1
        if self.world % (self.tp * self.cp):
            raise ValueError(f"policy.tensor_parallel_size {self.tp} x context_parallel_size {self.cp} does not divide "
                             f"the trainer's {self.world} ranks")
        self.dp_rank, self.dp = self.rank // (self.tp * self.cp), self.world // (self.tp * self.cp)
        """Data-parallel rank and size: the ranks of one TP or CP group (consecutive ranks) train on the same rows."""
        self.device = torch.device(info.device)  # from the config (distributed.trainer_device), not the host
        cuda = self.device.type == "cuda"
        self.publish_dtype = getattr(torch, cfg.policy.precision)
        self.mesh = init_device_mesh(self.device.type, (self.dp, self.cp, self.tp), mesh_dim_names=("dp", "cp", "tp"))
        self.shard_mesh = self.mesh["dp"] if self.cp == 1 else \
            init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("fsdp",))
        """What FSDP2 shards over: the data-parallel ranks, or with context parallelism every rank (a CP group's
        ranks hold the same weights and each makes part of every gradient: context_parallel.py)."""
        context = self.mesh["cp"].get_group() if self.cp > 1 else None
        self.ep = cfg.policy.expert_parallel_size
        if self.world % self.ep:
            raise ValueError(f"policy.expert_parallel_size {self.ep} does not divide the trainer's {self.world} ranks")
        self.expert_mesh = init_device_mesh(self.device.type, (self.world // self.ep, self.ep),
                                            mesh_dim_names=("efsdp", "ep")) if self.ep > 1 else None
        """With expert parallelism: the experts' view of the same ranks (expert_parallel.py)."""
        fp32 = cfg.policy.model_copy(update={"precision": "float32"})
        load = load_scorer if cfg.algorithm == "rm" else load_policy  # rm: a scalar head (reward_head.py)
        model, self.tokenizer = load(fp32, cfg.run.seed, self.device)
        if context is not None:
            use_context_parallel_attention(model, context)
        self.lora = cfg.policy.lora_cfg if cfg.policy.lora_cfg.enabled else None
        if self.lora:
            apply_lora(model, self.lora, cfg.run.seed)
        if cfg.policy.activation_checkpointing:  # per decoder layer, non-reentrant: composes with FSDP2
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = self._shard(model, offload=cfg.policy.cpu_offload)
        self.tp_summed = grad_allreduce_params(self.model) if self.tp > 1 else []
        """Parameters whose gradients are summed over the TP group (after FSDP2 made them its own)."""
        self.reference = None
        wants_reference = cfg.loss_fn.reference_policy_kl_penalty > 0 or cfg.algorithm == "dpo"
        if wants_reference and not self.lora:  # a frozen copy of the initial weights
            reference, _ = load_policy(fp32, cfg.run.seed, self.device)
            if context is not None:
                use_context_parallel_attention(reference, context)
            self.reference = self._shard(reference.requires_grad_(False), offload=cuda)
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # all but LoRA's frozen base
        self.optimizer = build_optimizer(trainable, cfg.policy.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.policy.scheduler)
        # Offline algorithms score data, not samples: NeMo RL's SFT and DPO take logprobs at temperature 1.
        temperature = cfg.policy.generation.temperature if cfg.offline is None else 1.0
        self.forward = Forward(cfg.policy, temperature, self.device, context)

    def _shard(self, model: torch.nn.Module, offload: bool) -> torch.nn.Module:
        """With policy.tensor_parallel_size > 1, first split the linear layers over the TP ranks
        (`tensor_parallel`); with policy.expert_parallel_size > 1, split the experts over their EP mesh and shard
        them over theirs (`shard_experts`); then fully_shard each decoder layer (`decoder_layers`), then the root,
        over the data-parallel ranks. `offload` keeps the shards in host memory between uses (the reference
        policy on GPU, and the policy with policy.cpu_offload): FSDP copies them in for each forward and
        backward, gradients come back to the host and the optimizer steps there. Pinned on GPU for faster
        copies; on CPU there is no device memory to pin against.

        One CPU rank is left a plain module: there is nothing to shard, no mixed precision and no
        offload, and DTensor dispatch on every op cost ~30% of a training step's CPU here (torchtitan
        likewise applies FSDP only when the data-parallel shard degree is above 1)."""
        if self.world == 1 and self.device.type == "cpu":
            return model
        if self.tp > 1:
            tensor_parallel(model, self.mesh["tp"])
        mp = MixedPrecisionPolicy(param_dtype=self.publish_dtype, reduce_dtype=torch.float32) \
            if self.device.type == "cuda" else MixedPrecisionPolicy()
        kwargs = dict(mp_policy=mp)
        if offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        if self.expert_mesh is not None:
            shard_experts(model, self.expert_mesh, self.mesh["tp"], self.dp, **kwargs)
        kwargs["mesh"] = self.shard_mesh
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        return fully_shard(model, **kwargs)

    # ---- logprobs ------------------------------------------------------------------------------

    @torch.no_grad()
    def _all_logprobs(self, model: torch.nn.Module, b: TrainBatch, lengths: list[int]) -> Tensor:
        """[B, L-1] target logprobs for the rows this rank trains on (zeros elsewhere)."""
        p = self.cfg.policy
        out = torch.zeros(b.targets.shape, dtype=torch.float32)
        micro = p.logprob_batch_size or p.train_micro_batch_size
        for rows in logprob_plan(lengths, self.dp_rank, self.dp, global_batch=p.train_global_batch_size,
                                 micro=micro, budget=self.forward.budget(train=False)):
            values = self.forward.logprobs(model, b, rows or [0])  # an empty micro-batch still joins the collectives
            if rows:
                out[rows, : values.shape[1]] = values.float().cpu()
        return out

    def _prev_logprobs(self, b: TrainBatch, lengths: list[int], num_updates: int) -> Tensor | None:
        """The weights' logprobs before the step's updates, or None for the loss to take its own forward's,
        detached: with one optimizer step those come from the same weights. Skipping this forward over the
        whole batch saved 22% of the toy step's training time (docs/benchmarks.md)."""
        if num_updates == 1 or self.cfg.loss_fn.force_on_policy_ratio:
            return None
        return self._all_logprobs(self.model, b, lengths)

    def _mask_by_sequence_error(self, b: TrainBatch, lengths: list[int], prev: Tensor | None
                                ) -> tuple[TrainBatch, dict[str, float]]:
        """grpo.seq_logprob_error_threshold: the batch with the samples the engine got wrong out of the loss, the same
        on every rank. It needs the weights' logprobs of every row before the step: `prev` when the step computed
        them (several optimizer steps), else one more forward; the loss keeps its own prev either way."""
        threshold = self.cfg.grpo.seq_logprob_error_threshold
        if threshold is None:
            return b, {}
        logprobs = prev if prev is not None else self._all_logprobs(self.model, b, lengths)
        if self.dp > 1:  # each data-parallel rank has its own rows (zeros elsewhere): the sum is every row
            summed = logprobs.to(self.device, copy=True)
            dist.all_reduce(summed, group=self.mesh["dp"].get_group())
            logprobs = summed.cpu()
        return mask_batch_by_sequence_error(b, logprobs, threshold)

    def _reference_logprobs(self, b: TrainBatch, lengths: list[int]) -> Tensor | None:
        """With LoRA the reference policy is the frozen base: the policy with its adapters off."""
        if self.reference is not None:
            return self._all_logprobs(self.reference, b, lengths)
        if self.lora and self.cfg.loss_fn.reference_policy_kl_penalty > 0:
            with adapters_off(self.model):
                return self._all_logprobs(self.model, b, lengths)
        return None

    def optimizer_offloaded(self):
        """The optimizer's state in host memory for the block (policy.offload_optimizer_for_logprob)."""
        if self.cfg.policy.offload_optimizer_for_logprob:
            return state_in_host_memory(self.optimizer)
        return contextlib.nullcontext()

    # ---- training ------------------------------------------------------------------------------

    def train_step(self, b: TrainBatch, advantages: Tensor) -> dict[str, float]:
        lengths = b.attention_mask.sum(1).tolist()
        p = self.cfg.policy
        t0 = time.perf_counter()
        steps = optimizer_steps(len(b), p.train_global_batch_size)
        with self.optimizer_offloaded():
            prev = self._prev_logprobs(b, lengths, len(steps))
            b, masking = self._mask_by_sequence_error(b, lengths, prev)
            ref = self._reference_logprobs(b, lengths)
        t1 = time.perf_counter()
        data = LossInputs(prev_logprobs=prev, generation_logprobs=b.generation_logprobs, reference_logprobs=ref,
                          advantages=advantages, token_mask=b.token_mask, sample_mask=b.sample_mask)
        plan = train_plan(lengths, self.dp_rank, self.dp, global_batch=p.train_global_batch_size,
                          micro=p.train_micro_batch_size, budget=self.forward.budget(train=True))
        self.model.train()
        try:
            reports = [self._optimizer_step(b, data, list(chunk), micro_batches)
                       for chunk, micro_batches in zip(steps, plan)]
        finally:
            self.model.eval()
        self.scheduler.step()
        # This rank's wall time: recomputing prev (if needed) and reference logprobs, then the optimizer steps.
        return _mean_over_steps(reports) | masking | {"timing/train/logprobs": t1 - t0,
                                                      "timing/train/optimizer": time.perf_counter() - t1}

    def offline_step(self, b: TrainBatch) -> dict[str, float]:
        """SFT or DPO: one optimizer step on the whole batch (offline_step.py)."""
        return offline_step(self, b)

    def validate(self, b: TrainBatch) -> dict[str, float]:
        return offline_validate(self, b)

    def distill_step(self, b: TrainBatch, advantages: Tensor | None = None) -> dict[str, float]:
        """On-policy distillation: the KL to the teacher's top-k instead of GRPO's loss (distill_step.py)."""
        return distill_step(self, b, advantages)

    def _optimizer_step(self, b: TrainBatch, data: LossInputs, chunk: list[int],
                        micro_batches: list[list[int]]) -> dict[str, float]:
        mask = b.token_mask[chunk] * b.sample_mask[chunk, None]
        totals = dict(global_valid_tokens=max(1.0, mask.sum().item()),
                      global_valid_seqs=max(1.0, b.sample_mask[chunk].sum().item()))
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        for rows in micro_batches:
            curr = self.forward.logprobs(self.model, b, rows or [chunk[0]])
            part = self.forward.loss_inputs(data, rows or [chunk[0]], curr.shape[1])
            loss, m = clipped_pg_loss(curr, part, self.cfg.loss_fn, **totals)
            (loss * (self.dp if rows else 0.0)).backward()  # FSDP averages over dp; an empty micro-batch adds 0
            if rows:
                metrics = combine_metrics(metrics, m)
        sum_over_tp(self.tp_summed, self.mesh["tp"])
        metrics = _combine_over_ranks(metrics, self.mesh["dp"])  # a TP group's ranks report the same rows
        max_norm = self.cfg.policy.max_grad_norm or float("inf")
        norm = clip_grad_norm(list(self.model.parameters()), max_norm)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # freed now, not at the next step: its logprob forwards run without them
        metrics["grad_norm"] = float(norm)
        return metrics

    # ---- weights and checkpoints ---------------------------------------------------------------

    def full_state_dict(self) -> dict[str, Tensor]:
        """Cast to the publish dtype before each gather; only rank 0 (the weight channel's sender) keeps the
        dict, on the device the channel sends from: the GPU for nccl, else host memory (full_weights.py)."""
        on = self.device if self.cfg.weight_sync.backend == "nccl" else torch.device("cpu")
        return full_weights(self.model, self.publish_dtype, keep=self.rank == 0, device=on,
                            lora_scale=self.lora.scale if self.lora else None)

    def save(self, directory: Path) -> None:
        model, optim = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model, "optim": optim}, checkpoint_id=str(directory / "policy"))
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")

    def load(self, directory: Path) -> None:
        model, optim = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optim": optim}
        dcp.load(state, checkpoint_id=str(directory / "policy"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))

    def hf_files(self, directory: Path) -> None:
        model = self.model
        model.config.save_pretrained(directory)
        if getattr(model, "generation_config", None) is not None:  # a reward model generates nothing
            model.generation_config.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 shards one by one: those of the classes the model's `_no_split_modules` names (its
    decoder layers: Qwen2DecoderLayer, LlamaDecoderLayer, NemotronHBlock, ...), wherever the model keeps them."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class in _no_split_modules; "
                         "FSDP2 shards a model one decoder layer at a time")
    return layers


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> Tensor:
    """torch's clip_grad_norm_ (norm 2, the same 1e-6) for parameters on several device meshes: with TP the
    split layers live on the (dp, tp) mesh and the rest on dp's, and torch's stacks their norms, which DTensor
    refuses across meshes. Returns the total norm before clipping."""
    groups: dict[object, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    squares = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float().square())
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    coef = min(1.0, max_norm / (total.item() + 1e-6))
    if coef < 1.0:
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


def _combine_over_ranks(metrics: dict[str, float], mesh) -> dict[str, float]:
    """Sum, min or max each metric over the data-parallel ranks of `mesh` (a rank may have no rows, hence no keys)."""
    if mesh.size() == 1:
        return metrics
    parts: list[dict[str, float]] = [{} for _ in range(mesh.size())]
    dist.all_gather_object(parts, metrics, group=mesh.get_group())
    out: dict[str, float] = {}
    for part in parts:
        out = combine_metrics(out, part)
    return out


def _mean_over_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """One trainer step's metrics from its optimizer steps: extremes over all, the rest averaged;
    lr is the one the last optimizer step used."""
    out: dict[str, float] = {}
    for step in steps:
        out = combine_metrics(out, step)
    for name, value in out.items():
        if reduction(name) == "sum" and name != "lr":
            out[name] = value / len(steps)
    out["lr"] = steps[-1]["lr"]
    return out
