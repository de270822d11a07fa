"""The Megatron-Core backend (policy.megatron_cfg.enabled): tensor, pipeline, sequence, context and expert parallel
GPTModel.

megatron-core 0.16.1 needs CUDA for a forward pass. What runs on CPU is tested there: the weight conversion
(hf_megatron.py, bit for bit, and in the rollout manifest's order, tied and untied), building the model
(megatron_model.py: layer spec, TransformerConfig, PP = 2 and TP = 2 on two gloo ranks, the weights loaded and
gathered back), its checkpoint directory, and the chunked vocab-parallel logprobs. The schedule and per-group
weight decay are tested on megatron-core's own param groups (tests/unit/trainer/test_megatron_schedule.py). On one
H100 (docs/gpu.md) the GPU check ran TP = PP = 1: logits against the HF model, a step, the manifest, a checkpoint
saved and loaded, float32 and bfloat16. TP or PP > 1 on GPUs, the gathers on NCCL, the sequence masking's
forward (grpo.seq_logprob_error_threshold), Qwen3-MoE (its router and experts, expert and sequence parallelism)
and context parallelism have not executed; the GPU check holds them for the next GPU run (EP, SP, CP need 2 GPUs).

Layout: ranks = data parallel x pipeline x context x tensor (initialize_model_parallel); a MoE layer's experts are
split over expert_model_parallel_size ranks of the data-parallel x tensor grid. The HF weights are loaded on CPU,
converted, and each rank keeps its pipeline stage's experts and tensor shard. Loss and normalisation are the FSDP2
backend's: clipped_pg_loss with the step's global counts; the schedule divides each micro-batch loss by the number
of micro-batches and DDP averages over data-parallel ranks, so the loss is multiplied by both to make them sums.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from services.common.config import FlywheelConfig
from services.common.modeling import load_policy
from services.trainer.algorithms import LossInputs, clipped_pg_loss
from services.trainer.algorithms.metrics import combine_metrics
from services.trainer.backends import TrainingBackend
from services.trainer.backends.hf_megatron import Shape
from services.trainer.backends.megatron_model import build_gpt, gather_hf, te_available, vocab_parallel_logprobs
from services.trainer.batch import TrainBatch, mask_batch_by_sequence_error
from services.trainer.distributed import RankInfo
from services.trainer.optim import build_scheduler


class MegatronBackend(TrainingBackend):
    def __init__(self, cfg: FlywheelConfig, info: RankInfo) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("policy.megatron_cfg.enabled needs CUDA: megatron-core cannot run a forward pass "
                               "on CPU; use the FSDP2 backend (megatron_cfg.enabled=false) here")
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        m = cfg.policy.megatron_cfg
        self.cfg, self.rank, self.world = cfg, info.rank, info.world
        # Whole experts on each rank (megatron's default would split them over the tensor-parallel ranks too)
        ps.initialize_model_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                                     context_parallel_size=m.context_parallel_size,
                                     expert_model_parallel_size=m.expert_model_parallel_size,
                                     expert_tensor_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.run.seed)
        self.ps, self.tp, self.pp = ps, m.tensor_model_parallel_size, m.pipeline_model_parallel_size
        hf, self.tokenizer = load_policy(cfg.policy.model_copy(update={"precision": "float32"}), cfg.run.seed)
        self.hf_config, self.generation_config = hf.config, hf.generation_config
        self.hf_names = list(hf.state_dict())  # the rollout's manifest order
        self.shape = Shape.of(hf.config, fused_norms=te_available())
        self.model = self._build(hf)
        self.optimizer = self._optimizer()
        self.torch_optimizers = torch_optimizers(self.optimizer)
        self.schedulers = schedule(self.torch_optimizers, cfg.policy.scheduler)
        self.tconfig.grad_scale_func = self.optimizer.scale_loss  # fp16's loss scale; 1 otherwise

    def _build(self, hf) -> torch.nn.Module:
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)

        module, self.gpt = build_gpt(hf, self.cfg.policy)
        self.tconfig = self.gpt.config
        # The schedule calls it after the last micro-batch: DDP's all-reduce, then a tied model's embedding
        # gradients summed between the first and last pipeline stages.
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        return DistributedDataParallel(config=self.tconfig, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True), module=module)

    def _optimizer(self):
        from megatron.core.optimizer import get_megatron_optimizer

        return get_megatron_optimizer(optimizer_config(self.cfg, self.tconfig), [self.model])

    # ---- training ------------------------------------------------------------------------------

    def _run(self, batch: TrainBatch, rows: list[list[int]], loss_of, forward_only: bool = False):
        """Megatron's schedule over the micro-batches `rows`; on the last pipeline stage loss_of(rows, logprobs)
        gets the weights' [rows, L-1] logprobs of the batch's targets, whole rows on every context-parallel rank."""
        import torch.nn.functional as F
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from services.trainer.backends.megatron_context_parallel import whole_row, zigzag_positions

        ps, p = self.ps, self.cfg.policy
        cp = ps.get_context_parallel_world_size()
        length = batch.input_ids.shape[1]
        width = padded_width(length, self.tp if self.tconfig.sequence_parallel else 1, cp)
        mine = zigzag_positions(width, cp, ps.get_context_parallel_rank()) if cp > 1 else torch.arange(width)
        # Causal attention: the padding at the end changes no earlier position, and its logprobs are dropped.
        ids = F.pad(batch.input_ids, (0, width - length))[:, mine]
        targets = F.pad(batch.targets, (0, width - length + 1))[:, mine]  # each position's next token
        # Float16Module's logits stay in the compute dtype: vocab_parallel_logprobs upcasts a chunk at a time.
        half = dict(fp32_output=False) if self.tconfig.bf16 or self.tconfig.fp16 else {}

        def step(iterator, model):
            mb = next(iterator)
            logits = model(input_ids=ids[mb].cuda(), position_ids=None, attention_mask=None, **half)

            def loss(out: Tensor):
                logprobs = vocab_parallel_logprobs(out, targets[mb].cuda(), p.generation.temperature,
                                                   p.logprob_chunk_size)
                if cp > 1:
                    logprobs = whole_row(logprobs, ps.get_context_parallel_group())
                return loss_of(mb, logprobs[:, :length - 1])

            return logits, loss

        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(rows), model=[self.model], num_microbatches=len(rows),
            seq_length=width, micro_batch_size=max(map(len, rows)), forward_only=forward_only)

    def train_step(self, b: TrainBatch, advantages: Tensor) -> dict[str, float]:
        dp, cp = self.ps.get_data_parallel_world_size(), self.ps.get_context_parallel_world_size()
        rows = micro_batches(len(b), self.ps.get_data_parallel_rank(), dp, self.cfg.policy.train_micro_batch_size,
                             self.pp)
        b, masking = self._mask_by_sequence_error(b, rows)
        mask = b.token_mask * b.sample_mask[:, None]
        totals = dict(global_valid_tokens=max(1.0, mask.sum().item()),
                      global_valid_seqs=max(1.0, b.sample_mask.sum().item()))
        # One optimizer step per batch: prev = sg(lp) (loss.py), no forward to recompute it.
        data = LossInputs(prev_logprobs=None, generation_logprobs=b.generation_logprobs, advantages=advantages,
                          token_mask=b.token_mask, sample_mask=b.sample_mask)

        def loss_of(mb_rows, curr):
            part = LossInputs(**{f: getattr(data, f)[mb_rows].cuda() if getattr(data, f) is not None else None
                                 for f in LossInputs.__slots__})
            loss, metrics = clipped_pg_loss(curr, part, self.cfg.loss_fn, **totals)
            # Undo the schedule's and DDP's averaging. Under context parallelism each rank's loss is the whole
            # rows' (megatron_context_parallel.py): the schedule multiplies it by cp, and the logprobs' gather sums
            # cp copies of its gradient, where DDP averages over dp x cp ranks: one division by cp cancels.
            return loss * len(rows) * dp / cp, metrics

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self._run(b, rows, loss_of)
        ok, grad_norm, _ = self.optimizer.step()
        metrics = self._step_metrics(reports)
        metrics |= {"grad_norm": float(grad_norm or 0.0), "lr": self.optimizer.param_groups[0]["lr"]}
        for s in self.schedulers:  # once per trainer step, after it, as the FSDP2 backend and NeMo RL step it
            s.step()
        return metrics | masking

    def _step_metrics(self, reports: list[dict[str, float]]) -> dict[str, float]:
        """The loss's metrics of the whole step, the same on every rank: the schedule returns each micro-batch's on
        the last pipeline stage only ({} elsewhere), so they are combined there (sums added, extremes kept) over
        the micro-batches and the data-parallel ranks, then sent to the other stages."""
        import torch.distributed as dist

        ps, out = self.ps, {}
        parts: list[dict[str, float]] = [{} for _ in range(ps.get_data_parallel_world_size())]
        dist.all_gather_object(parts, reports, group=ps.get_data_parallel_group())
        for part in (report for rank in parts for report in rank):
            out = combine_metrics(out, part)
        if self.pp > 1:
            box = [out]
            dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                       group=ps.get_pipeline_model_parallel_group())
            out = box[0]
        return out

    def _mask_by_sequence_error(self, b: TrainBatch, rows: list[list[int]]) -> tuple[TrainBatch, dict[str, float]]:
        """grpo.seq_logprob_error_threshold: the batch with the samples the engine got wrong out of the loss, the same
        on every rank, from the weights' logprobs of every row before the step (one forward-only pass), as the FSDP2
        backend and NeMo RL mask."""
        threshold = self.cfg.grpo.seq_logprob_error_threshold
        if threshold is None:
            return b, {}
        return mask_batch_by_sequence_error(b, self._all_logprobs(b, rows), threshold)

    def _all_logprobs(self, b: TrainBatch, rows: list[list[int]]) -> Tensor:
        """[B, L-1] logprobs of every row under the current weights, on every rank: this data-parallel rank's rows
        through a forward-only schedule (the last pipeline stage has them), summed over the data-parallel group
        (each rank fills its own rows, zeros elsewhere), then broadcast from the last stage to the others."""
        ps = self.ps
        out = torch.zeros(b.targets.shape, dtype=torch.float32, device="cuda")

        def keep(mb_rows, logprobs):
            out[mb_rows] = logprobs.detach()
            return logprobs.sum() * 0, {}

        self.model.eval()  # no dropout (policy.hf_config_overrides may set some), no recompute
        with torch.no_grad():
            self._run(b, rows, keep, forward_only=True)
        self.model.train()
        torch.distributed.all_reduce(out, group=ps.get_data_parallel_group())
        if self.pp > 1:
            torch.distributed.broadcast(out, src=ps.get_pipeline_model_parallel_last_rank(),
                                        group=ps.get_pipeline_model_parallel_group())
        return out.cpu()

    # ---- weights and checkpoints ---------------------------------------------------------------

    def full_state_dict(self) -> dict[str, Tensor]:
        """Gather tensor shards, then pipeline stages, to global rank 0; convert to HF names there."""
        hf = gather_hf(self.gpt, self.shape)
        if self.rank != 0:
            return {}
        if list(hf) != self.hf_names:  # the rollout would refuse the manifest's digest
            raise RuntimeError(f"Megatron -> HF names differ from the HF model's: "
                               f"{sorted(set(hf) ^ set(self.hf_names)) or 'same names, another order'}")
        return {k: v.to(getattr(torch, self.cfg.policy.precision)) for k, v in hf.items()}

    def save(self, directory: Path) -> None:
        save_sharded(self.gpt, directory / "policy")
        if self.rank == 0:  # every rank runs the same schedule
            torch.save([s.state_dict() for s in self.schedulers], directory / "scheduler.pt")

    def load(self, directory: Path) -> None:
        load_sharded(self.gpt, directory / "policy")
        # Under bf16 the optimizer holds fp32 copies made at build; without this its next step would copy them back
        # over the loaded weights (megatron's docstring: call it when loading a model without its optimizer).
        # Ran on one H100 in float32 (docs/gpu.md); not yet under bf16, where it matters.
        self.optimizer.reload_model_params()
        restore(self.torch_optimizers, self.schedulers, torch.load(directory / "scheduler.pt", weights_only=True))

    def hf_files(self, directory: Path) -> None:
        self.hf_config.save_pretrained(directory)
        self.generation_config.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)


def optimizer_config(cfg: FlywheelConfig, tconfig):
    """Megatron's OptimizerConfig for policy.optimizer (the torch name nemo_rl_megatron.py maps megatron_cfg's
    optimizer onto): adam runs torch's AdamW, or Adam with decoupled_weight_decay off."""
    from megatron.core.optimizer import OptimizerConfig

    o = cfg.policy.optimizer
    name = o.name.rsplit(".", 1)[-1].lower()
    if name not in ("adamw", "adam", "sgd"):
        raise ValueError(f"the Megatron backend supports AdamW, Adam and SGD, not {o.name}")
    k = o.kwargs
    betas = k.get("betas", (0.9, 0.999))
    return OptimizerConfig(
        optimizer="sgd" if name == "sgd" else "adam", decoupled_weight_decay=name != "adam", lr=k["lr"],
        weight_decay=k.get("weight_decay", 0.0), adam_beta1=betas[0], adam_beta2=betas[1],
        adam_eps=k.get("eps", 1e-8), clip_grad=cfg.policy.max_grad_norm or 0.0, bf16=tconfig.bf16,
        fp16=tconfig.fp16, params_dtype=tconfig.params_dtype)


def torch_optimizers(optimizer) -> list[Optimizer]:
    """The torch optimizers inside megatron's (a ChainedOptimizer of one per dense / expert part, each wrapping
    one): their param groups are the ones megatron's own OptimizerParamScheduler would set lr and decay on."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def schedule(optimizers: list[Optimizer], entries: list) -> list[LRScheduler]:
    """policy.scheduler (NeMo RL's Megatron schedule as torch schedulers, nemo_rl_megatron.py) on each optimizer,
    and megatron's per-group weight decay: its groups mark biases and 1-d weights (norms) wd_mult 0, which only
    megatron's scheduler, not run here, applies. The decay itself is constant: nemo_rl_megatron.py refuses more."""
    for o in optimizers:
        for g in o.param_groups:
            g["weight_decay"] *= g.get("wd_mult", 1.0)
    return [build_scheduler(o, entries) for o in optimizers]


def restore(optimizers: list[Optimizer], schedulers: list[LRScheduler], states: list[dict]) -> None:
    """Resume the schedule saved with the checkpoint. The optimizer's own state is not saved (docs/trainer.md), so
    the groups' lr, from which torch's schedulers take each next step, is set from the schedule here."""
    for o, s, state in zip(optimizers, schedulers, states, strict=True):
        s.load_state_dict(state)
        for g, lr in zip(o.param_groups, s.get_last_lr(), strict=True):
            g["lr"] = lr


def padded_width(length: int, tp: int, cp: int) -> int:
    """`length` rounded up to what splits evenly: `cp` context-parallel ranks hold 2 chunks each, and sequence
    parallelism (`tp` > 1) gives each tensor-parallel rank an equal slice of those (NeMo RL's
    make_sequence_length_divisible_by)."""
    unit = tp * (2 * cp if cp > 1 else 1)
    return -(-length // unit) * unit


def micro_batches(n: int, dp_rank: int, dp: int, size: int, pp: int) -> list[list[int]]:
    """This data-parallel rank's rows of an n-row batch (every dp-th), in micro-batches of `size` rows. Every rank
    needs rows (the schedule runs at least one micro-batch, and the others wait in its collectives); with pipeline
    stages every micro-batch must hold `size` rows: the schedule sends activations of that fixed shape. Both are
    checked on the batch's shape, not this rank's share, so that every rank refuses it, none waiting on another."""
    if n < dp:
        raise ValueError(f"a batch of {n} rows cannot give each of {dp} data-parallel ranks a row")
    if pp > 1 and n % (dp * size):
        raise ValueError(f"pipeline_model_parallel_size {pp} needs micro-batches of exactly train_micro_batch_size "
                         f"{size} rows on each of {dp} data-parallel ranks: a batch of {n} rows does not divide")
    mine = list(range(dp_rank, n, dp))
    return [mine[i:i + size] for i in range(0, len(mine), size)]


def save_sharded(gpt: torch.nn.Module, target: Path) -> None:
    """Collective: every rank writes its shards of `gpt` into `target` (CUDA only: megatron-core 0.16's writer
    synchronises the device and gathers its results on it)."""
    from megatron.core import dist_checkpointing

    make_checkpoint_dir(target)
    dist_checkpointing.save(gpt.sharded_state_dict(), str(target))


def make_checkpoint_dir(target: Path) -> None:
    """Collective: rank 0 creates `target`, the others wait for it; dist_checkpointing.save refuses a missing
    directory. `target` sits inside the checkpoint's tmp_step_N, which checkpoint.py renames once every rank
    has finished: the save is atomic there."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        target.mkdir(parents=True)
    dist.barrier()


def load_sharded(gpt: torch.nn.Module, target: Path) -> None:
    """Collective: load what save_sharded wrote into `gpt`, each rank its shards."""
    from megatron.core import dist_checkpointing

    gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), str(target)))
