"""The one training loop: forward, loss, backward, step, schedule, validation, logging, checkpoints."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import torch
from torch.profiler import record_function

from distributed.collectives import all_reduce_, mean_over
from distributed.counting import count_compiled
from distributed.data_parallel import no_sync, sync_partial_grads
from distributed.grad_norm import clip_grad_norm
from distributed.rng import rng_tensors, seed_default_stream, set_rng_tensors
from utils import require
from utils.checkpoints.checkpointer import Checkpointer
from utils.checkpoints.sharded_state import View, checkpoint_view, read_shapes
from utils.comm import Grid
from utils.data.batching import Loaders, SharedBatches
from utils.engine.fingerprints import fingerprinted, recording
from utils.engine.flops import mfu, tflops_per_device
from utils.engine.logger import Progress, TensorBoard
from utils.engine.memory import MemoryLedger, host_peak_gib, peak_memory_gib
from utils.engine.optim import build_scheduler
from utils.engine.precision import autocast
from utils.engine.preemption import EXIT_PREEMPTED, StopRequest
from utils.engine.profiling import StepProfiler
from utils.engine.step_results import StepResult, StepResults
from utils.engine.watchdog import StepWatchdog


class Trainer:
    """Runs `max_steps` optimizer steps of a built model on a built task; see utils/engine/build.py.

    `loaders` (None until `utils.engine.build.start_run` attaches them) feed `fit`; `train_step` alone needs none.
    """

    def __init__(self, *, cfg, grid: Grid, task, built, optimizer, scheduler, scaler, run_dir, log,
                 checkpointer: Checkpointer):
        self.cfg, self.tc, self.grid, self.task = cfg, cfg.trainer, grid, task
        self.model, self.raw_model = built.model, built.raw
        self.pipeline, self.forward_model = built.pipeline, built.forward or built.raw  # see utils/engine/build.py
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.loaders: Loaders | None = None
        self.run_dir, self.log, self.step = run_dir, log, 0
        self.device = grid.device
        self.autocast = partial(autocast, cfg.precision.mode, self.device)
        self.batch = grid.batch  # the loss is averaged over the ranks that split the batch
        self.checkpointer = checkpointer
        self.tb = TensorBoard(run_dir, grid.is_main, images=self.tc.log_images)
        self.progress = Progress(log, self.tc.max_steps, self.tc.log_every, grid.is_main, task.rollout_length)
        self.flops_per_sample = built.flops_per_sample
        self.skipped_steps, self.consecutive_skips = 0, 0  # trainer.nonfinite=skip
        self.stop_requested = False  # a stop signal on this rank when the next step begins
        self.stop_request: StopRequest | None = None  # the handlers build_run installed, for fit to act on
        self.flags = torch.zeros(3, device=self.device)  # the last step's agreed [non-finite, stop, host GiB]
        self.memory = MemoryLedger(self.device)  # this rank's high-water marks by phase (utils/engine/memory.py)
        self.results = StepResults(self.device)  # step scalars on their way to the host (utils/engine/step_results.py)
        self.watchdog = StepWatchdog(0, run_dir, grid.global_rank)  # off outside fit (e.g. the benchmark)
        self.profiler = StepProfiler(self.tc, run_dir, grid.global_rank, grid.is_main, self.device, log)

    def save_checkpoint(self, background: bool | None = None) -> Path:
        """Write the checkpoint of the step reached (collective; see utils/checkpoints/checkpointer.py): the model and
        Adam state under single-process names and global shapes, this rank's RNG, and in state.json the
        step, the samples consumed, the lr (for readers: a resume rebuilds the schedule at its step) and the scaler."""
        view = checkpoint_view(self.raw_model, self.optimizer, self.grid, for_load=False)
        view.tensors.update(rng_tensors(self.rng_prefix))
        meta = {"samples": self.step * self.tc.global_batch_size, "global_batch_size": self.tc.global_batch_size,
                "layout": self.grid.signature, "lr": self.scheduler.get_last_lr()[0],
                "scaler": self.scaler.state_dict()}
        background = self.tc.ckpt_async if background is None else background
        self.background_save_done(wait=True)  # one save in flight
        path = self.checkpointer.save(self.step, view.tensors, meta, background)
        self.memory.mark("checkpoint save")
        return path

    def background_save_done(self, wait: bool) -> None:
        """Publish a background save that completed (`wait`: wait for it), and say so."""
        if (path := self.checkpointer.wait() if wait else self.checkpointer.poll()) is not None:
            self.progress.message(f"saved checkpoint {path} (in the background)")

    @property
    def rng_prefix(self) -> str:
        return f"rng/{self.grid.global_rank}/"

    def checkpoint_destination(self, meta: dict, path: Path) -> View:
        """What this rank reads from a checkpoint: its model and optimizer state in this layout, and its
        RNG state when the checkpoint was written by this same layout."""
        view = checkpoint_view(self.raw_model, self.optimizer, self.grid, for_load=True)
        if meta.get("layout") == self.grid.signature:  # the RNG states it has (no CUDA state from a CPU run)
            saved = read_shapes(path)
            view.tensors.update({k: torch.empty_like(v) for k, v in rng_tensors(self.rng_prefix).items() if k in saved})
        return view

    def restore(self, meta: dict, view: View) -> None:
        """Continue from a checkpoint read into `checkpoint_destination`'s view."""
        step = int(meta["step"])
        require(meta["samples"] == step * self.tc.global_batch_size,
                f"the checkpoint consumed {meta['samples']} samples in {step} steps of {meta['global_batch_size']}",
                "trainer.global_batch_size", f"resume with trainer.global_batch_size={meta['global_batch_size']}")
        self.scheduler = build_scheduler(self.cfg.optim, self.optimizer, self.tc.max_steps, step)  # sets each lr
        self.scaler.load_state_dict(meta["scaler"])
        self.step = step
        if f"{self.rng_prefix}torch" in view.tensors:
            set_rng_tensors(view.tensors, self.rng_prefix)
        else:
            seed_default_stream(self.tc.seed, self.grid, step)
            self.log.info(f"the checkpoint was written by the layout '{meta.get('layout')}': random streams "
                          f"re-derived from (seed, step {step}, rank) for '{self.grid.signature}'")
        self.tb = TensorBoard(self.run_dir, self.grid.is_main, self.step, self.tc.log_images)  # purges later events

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (global-batch mean loss, global gradient norm) as device tensors, read by nothing here:
        the step queues its work and never waits for the device (fused Adam; see `step_optimizer`).

        Without a loss scaler, a non-finite loss or gradient norm on any rank skips the update on every
        rank (`self.skipped` says so); the fp16 scaler keeps its own skip logic. `self.flags[1]`: some
        rank had `stop_requested` (a stop signal) when the step began. The lr used is `self.current_lr()`.
        """
        with record_function("forward_backward"), recording(self, self.step + 1):  # profiles' ranges; fingerprints
            if self.pipeline is not None:
                total = self.pipeline.train_step(inputs, targets, self.tc.grad_accum_steps, self.scaler.scale)
            else:
                total = self.forward_backward(inputs, targets)
        self.watchdog.phase("optimizer")
        with record_function("optimizer"):
            return self.finish_step(total)

    def finish_step(self, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient sync, clipping, the agreed flags and the update, after the backward of a step."""
        self.finish_grads()
        self.scaler.unscale_(self.optimizer)
        with fingerprinted(self, self.step + 1):  # trainer.fingerprint_steps: the grads, then the update
            grad_norm, loss = self.clip_grad_norm(), mean_over(total, self.batch)
            self.flags = self.agree_on_flags(loss, grad_norm)
            self.step_optimizer(self.flags[0])
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss, grad_norm

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Gradients of this rank's batch in grad_accum_steps micro-batches; returns its mean loss."""
        micro = self.tc.grad_accum_steps
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(micro), targets.chunk(micro))):
            sync = i == micro - 1  # dp reduces in the last micro-batch only  # plant: accumulation_syncs_first_micro
            with no_sync(self.model, skip=not sync, fsdp=not self.cfg.parallel.fsdp_reduce_every_microbatch):
                with self.autocast():
                    loss = self.task.training_loss(self.model, self.raw_model.criterion, x, y, self.step) / micro
                self.scaler.scale(loss).backward()
            total += loss.detach()
        return total

    def agree_on_flags(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """[non-finite loss or grad norm, stop requested, peak host GiB (mem/host_peak_gib)] max-reduced over all
        ranks (a device tensor), so every rank takes the same branch: a rank's replicated gradients are its own
        (one NaN there must not make it skip while the others step); ranks may see a stop signal at other steps."""
        bad = (~torch.isfinite(loss) | ~torch.isfinite(grad_norm)).float()
        stop, host = (torch.full((), v, device=self.device) for v in (float(self.stop_requested), host_peak_gib()))
        return all_reduce_(torch.stack([bad, stop, host]), self.grid.world, "max")

    def step_optimizer(self, bad: torch.Tensor) -> None:
        """The update, skipped on every rank when `bad` (0/1 on the device) is set, without reading it: fused
        Adam takes it as `found_inf` (the attribute protocol torch's GradScaler uses) and then leaves the
        weights, moments and step count as they were. foreach Adam (optim.fused=false) has no such input
        and reads the flag (one host sync). The fp16 scaler keeps its own per-rank skip logic."""
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)
        elif self.optimizer.defaults.get("fused"):
            self.optimizer.found_inf, self.optimizer.grad_scale = bad, None
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf, self.optimizer.grad_scale
        elif not bad.item():
            self.optimizer.step()

    @property
    def skipped(self) -> bool:
        """Whether every rank skipped the last step's update (reads the device)."""
        return bool(self.flags[0].item()) and not self.scaler.is_enabled()

    def finish_grads(self) -> None:
        """Reduce gradients that are partial sums over model-parallel axes (none without tp/cp), and
        under pp the data-parallel and tied-embedding reductions (distributed/pipeline/schedule.py)."""
        sync_partial_grads(self.raw_model)
        if self.pipeline is not None:
            self.pipeline.sync_grads()

    def clip_grad_norm(self) -> torch.Tensor:
        skip = self.pipeline.duplicates if self.pipeline is not None else set()
        return clip_grad_norm(self.raw_model, grid=self.grid, max_norm=self.cfg.optim.grad_clip, skip=skip)

    def current_lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return self.optimizer.param_groups[0]["lr"]

    def train_batches(self) -> SharedBatches:
        """The training batches from the step reached, on the device: read by one rank of the tp x cp group."""
        return SharedBatches(self.loaders.train, self.grid.same_batch, self.device)

    def fit(self) -> int:
        """Train to max_steps (or stop_at_step). Returns the exit status: 0, or EXIT_PREEMPTED when a stop
        signal arrived and the checkpoint of the step reached is written (utils/engine/preemption.py). Whatever
        way it ends (a return, a stop, an exception), the data workers end with it (`Loaders.close`)."""
        request, self.stop_request = self.stop_request or StopRequest(self.tc.preempt_deadline_s), None
        watchdog = StepWatchdog(self.tc.hang_timeout_s, self.run_dir, self.grid.global_rank)
        try:
            with request, watchdog:
                self.watchdog = watchdog
                return self.run_loop(request)
        finally:
            count_compiled(True)
            if self.loaders is not None:
                self.loaders.close()

    def run_loop(self, request: StopRequest) -> int:
        """fit's loop. A stop signal in the step that reaches max_steps changes nothing: the run validates,
        saves and ends with 0 like any finished run (a requeued job would find nothing to do)."""
        if self.step >= self.tc.max_steps:
            self.log.info(f"run.dir already holds a finished run at step {self.step}; nothing to do (set trainer."
                          f"resume=never or another {'run.dir' if self.cfg.run.dir else 'run.tag'} to start over)")
            return 0
        self.log.info(f"training from step {self.step} to {self.tc.max_steps}")
        if (saved := self.stop_before_start(request)) is not None:
            return self.exit_preempted(saved)
        batches = self.train_batches()
        self.model.train()
        stop = min(self.tc.max_steps, self.tc.stop_at_step or self.tc.max_steps)
        if self.step == 0 and self.tc.val_at_start:  # the untrained model's point on the val curves
            self.watchdog.phase("validation")
            self.validate()
        notice = self.progress.first_step_notice(self.step + 1)
        while self.step < stop:
            with self.profiler.step(self.step + 1, self.tb):  # a whole step, data included
                stopping = self.fit_step(batches, request)
            if notice is not None:  # the first step ended: no "still running" line any more
                notice.cancel()
            if not stopping and self.at_boundary(stop):  # validation/checkpoint: every step read first
                stopping = self.read_results(flush=True)
            if stopping:
                self.read_results(flush=True)
                if self.step < self.tc.max_steps:  # at max_steps a stop changes nothing
                    self.watchdog.phase("checkpoint")
                    return self.exit_preempted(self.save_checkpoint(background=False))
            self.maybe_validate_and_save(stop)
            self.background_save_done(wait=False)
        self.watchdog.phase("checkpoint")
        self.background_save_done(wait=True)
        self.memory.report(self.grid.world, self.grid.is_main, self.run_dir, self.log)  # memory.json, a log line
        self.tb.close(finished=self.step == self.tc.max_steps)
        return 0

    def stop_before_start(self, request: StopRequest) -> Path | None:
        """A stop signal received during set-up (build_run installs the handlers first thing), agreed by every
        rank before any step: the checkpoint of the step reached, written now unless this run's own
        checkpoint of that step exists (a resumed run: nothing to add); None without a stop. The run
        takes no step: a first step can take minutes (compilation), more than a notice ahead of a
        time limit gives, and a fresh run's step-0 checkpoint is its seeded initial state."""
        path = self.checkpointer.step_dir(self.step)
        flags = torch.tensor([float(request.requested), float(not self.checkpointer.is_complete(path))],
                             device=self.device)
        stop, missing = all_reduce_(flags, self.grid.world, "max").tolist()  # every rank takes the same branch
        if not stop:
            return None
        self.watchdog.phase("checkpoint")
        return self.save_checkpoint(background=False) if missing else path

    def exit_preempted(self, path: Path) -> int:
        """The end of a run stopped by a signal with the complete checkpoint `path` of the step reached."""
        self.progress.message(f"stop signal received: saved checkpoint {path}; exiting with status "
                              f"{EXIT_PREEMPTED} (run the same command again to continue)")
        self.tb.close()
        return EXIT_PREEMPTED

    def fit_step(self, batches, request: StopRequest) -> bool:
        """Queue one optimizer step on the next global batch, then log the steps whose results are due
        (utils/engine/step_results.py); returns whether those say every rank agreed to stop."""
        t0 = time.perf_counter()
        self.watchdog.phase("data")
        with record_function("data"):
            x, y = next(batches)  # on the device; read by one rank of the tp x cp group (SharedBatches)
        result = StepResult(self.step + 1, self.current_lr(), t0, time.perf_counter() - t0,
                            shared_bytes=batches.shared_bytes)
        self.grid.reset_comm_bytes()
        # compiled graphs count bytes only on steps with a log line (distributed/counting.py); eager always
        counted = not self.cfg.precision.compile or self.progress.is_log_step(result.step)
        count_compiled(counted)
        self.stop_requested = request.requested
        self.watchdog.phase("forward/backward")
        loss, grad_norm = self.train_step(x, y)
        self.step += 1
        self.memory.mark("first step")
        if counted:  # the agreement's bytes are part of the step's figures
            result.comm_bytes = self.grid.comm_bytes()
        self.results.push(result, torch.stack([loss.float(), grad_norm.float(), *self.flags]))
        return self.read_results()

    def read_results(self, flush: bool = False) -> bool:
        """Apply the non-finite policy to and log every step whose results are due; whether one says stop."""
        stop = False
        for result in self.results.pop(flush):
            self.apply_nonfinite_policy(result)
            self.log_step(result)
            stop |= result.stop
        return stop

    def due(self, stop: int) -> tuple[bool, bool, bool]:
        """(validate, rollout, save) after the step just taken, the one cadence rule: each every <its>_every steps,
        validation and rollouts (when set) also at max_steps, a checkpoint at the step the run stops at."""
        tc, step = self.tc, self.step
        return (step == tc.max_steps or bool(tc.val_every and step % tc.val_every == 0),
                bool(self.task.rollout_every) and (step == tc.max_steps or step % self.task.rollout_every == 0),
                step == stop or bool(tc.ckpt_every and step % tc.ckpt_every == 0))

    def at_boundary(self, stop: int) -> bool:
        """Whether validation or a checkpoint follows the step just taken."""
        return any(self.due(stop))

    def apply_nonfinite_policy(self, result: StepResult) -> None:
        """trainer.nonfinite for a step whose update every rank skipped: stop with one line, or count it
        (train/skipped_steps) and stop after max_skipped_steps in a row."""
        if not result.bad or self.scaler.is_enabled():  # the fp16 scaler skips and counts on its own
            self.consecutive_skips = 0
            return
        self.skipped_steps += 1
        self.consecutive_skips += 1
        what = f"non-finite loss ({result.loss}) or gradient norm ({result.grad_norm}) at step {result.step}"
        fix = "lower optim.lr, set optim.grad_clip, check the data"
        require(self.tc.nonfinite == "skip", what, "trainer.nonfinite", f"{fix}, or set trainer.nonfinite=skip")
        require(self.consecutive_skips <= self.tc.max_skipped_steps,
                f"{self.consecutive_skips} consecutive steps skipped, the last with a {what}",
                "trainer.max_skipped_steps", fix)
        self.log.warning(f"skipped the update of step {result.step}: {what}")

    def log_step(self, result: StepResult) -> None:
        """Scalars of a step taken, at x = steps completed (validation and checkpoints use it too)."""
        values = {"train/loss": result.loss, "train/lr": result.lr, "train/grad_norm": result.grad_norm,
                  "train/skipped_steps": self.skipped_steps, "data/shared_bytes": result.shared_bytes,
                  "perf/step_time_ms": 1e3 * result.step_time_s, "perf/data_wait_ms": 1e3 * result.data_wait_s,
                  **self.throughput(result.step_time_s), "mem/peak_gib": peak_memory_gib(self.device),
                  "mem/host_peak_gib": result.host_peak_gib}
        values.update({f"comm/{axis}_bytes": float(n) for axis, n in result.comm_bytes.items()})
        if self.pipeline is not None:  # measured idle fraction of the schedule's steps, and the theory's
            values["perf/pp_bubble"] = self.pipeline.bubble
            if (formula := self.pipeline.plan.bubble()) is not None:
                values["perf/pp_bubble_formula"] = formula
        self.tb.scalars(values, result.step)
        self.progress.update(result.step, result.loss, values["perf/samples_per_sec"], result.lr)

    def throughput(self, step_time: float) -> dict[str, float]:
        """perf/* figures of one optimizer step over the global batch taking `step_time` seconds."""
        batch = self.tc.global_batch_size
        values = {"perf/samples_per_sec": batch / step_time,
                  "perf/tokens_per_sec": batch * self.task.tokens_per_sample() / step_time,
                  "perf/tflops_per_sec": tflops_per_device(self.flops_per_sample, batch, step_time,
                                                           self.grid.world_size)}
        utilization = mfu(values["perf/tflops_per_sec"], self.device, self.cfg.precision.mode)
        if utilization is not None:
            values["perf/mfu"] = utilization
        return values

    def maybe_validate_and_save(self, stop: int) -> None:
        validate, rollout, save = self.due(stop)
        if validate:
            self.watchdog.phase("validation")
            self.validate()
        if rollout:
            self.watchdog.phase("rollout")
            self.rollout()
        if save:
            self.watchdog.phase("checkpoint")
            path = self.save_checkpoint()
            if self.checkpointer.pending is None:
                self.progress.message(f"saved checkpoint {path}")

    def rollout(self) -> dict[str, float]:
        """The task's multi-step forecast skill (every task.rollout_every steps), logged at this step."""
        return self._evaluate("rollout", lambda: self.task.evaluate_rollout(
            self.forward_model, grid=self.grid, autocast=self.autocast, writer=self.tb, step=self.step),
            lambda metrics: f"{len(metrics)} scalars rollout/<rmse|acc|bias>/<channel>/<lead>h")

    def validate(self) -> dict[str, float]:
        return self._evaluate("validation", lambda: self.task.evaluate(
            self.forward_model, self.raw_model.criterion, self.loaders.val, grid=self.grid, autocast=self.autocast,
            writer=self.tb, step=self.step), self.task.summary)

    def _evaluate(self, what: str, run, summary) -> dict[str, float]:
        """`run()` in eval mode, its scalars logged at this step with one line."""
        self.model.eval()
        t0 = time.perf_counter()
        metrics = run()
        self.model.train()
        self.tb.scalars(metrics, self.step)
        self.tb.flush()
        self.progress.message(f"step {self.step} {what} ({time.perf_counter() - t0:.1f}s): " + summary(metrics))
        return metrics
