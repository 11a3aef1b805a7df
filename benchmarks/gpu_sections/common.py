"""What every section of the GPU suite shares: the run's settings, the compile counter, the
interleaved timer, the cached llama-1b pair (ours and the plain-JAX peer, built once and
reused by speed, startup, memory and profile) and a table printer."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from benchmarks import mfu
from resihp_jax.data import BatchIterator, GlobalBatch
from resihp_jax.plan import Plan
from resihp_jax.models.config import ModelConfig, get_model_config
from resihp_jax.perfmodel.memory import devices_memory_gb
from resihp_jax.perfmodel.memory import remat_for_memory
from resihp_jax.step.config import StepConfig

# JAX records one event of this name per executable it builds (jax/_src/dispatch.py's
# BACKEND_COMPILE_EVENT; the suite reads the installed version's constant when it has one).
try:
    from jax._src.dispatch import BACKEND_COMPILE_EVENT as COMPILE_EVENT
except ImportError:  # pragma: no cover - a version that moved it
    COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_compiles = [0, 0.0]  # executables built in this process (every thread), their seconds
_installed = [False]
# The cold start's phases as JAX's own compile logging names them: tracing to a jaxpr,
# lowering to MLIR, and the backend's compile (XLA, with the Triton kernels inside it).
PHASE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
                "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
                COMPILE_EVENT: "backend_s"}
_phases = {name: 0.0 for name in PHASE_EVENTS.values()}


def _on_duration(event: str, duration_s: float, **_: object) -> None:
    phase = PHASE_EVENTS.get(event)
    if phase is None:
        return
    with _lock:
        _phases[phase] += duration_s
        if event == COMPILE_EVENT:
            _compiles[0] += 1
            _compiles[1] += duration_s


def phases_so_far() -> dict[str, float]:
    """Seconds spent so far in each compile phase (PHASE_EVENTS), all threads."""
    compiles_so_far()  # installs the listener
    with _lock:
        return dict(_phases)


def phases_since(before: dict[str, float]) -> dict[str, float]:
    return {name: round(value - before[name], 3) for name, value in phases_so_far().items()}


def compiles_so_far() -> tuple[int, float]:
    """(executables built so far, their compile seconds), all threads; listener set once."""
    with _lock:
        if not _installed[0]:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _installed[0] = True
        return int(_compiles[0]), float(_compiles[1])


@dataclass
class Cold:
    """One cold start: seconds from the call to the end of the first step, compiles built."""
    seconds: float
    compiles: int
    compile_s: float
    phases: dict[str, float] = field(default_factory=dict)


def cold_start(build: Callable[[], Any], first_step: Callable[[Any], Any]) -> tuple[Any, Cold]:
    """build() then first_step(built), timed and counted; returns (built, Cold)."""
    n0, s0 = compiles_so_far()
    p0 = phases_so_far()
    start = time.perf_counter()
    built = build()
    jax.block_until_ready(first_step(built))
    seconds = time.perf_counter() - start
    n1, s1 = compiles_so_far()
    return built, Cold(round(seconds, 3), n1 - n0, round(s1 - s0, 3), phases_since(p0))


def interleaved(calls: dict[str, Callable[[], Any]], warmup: int,
                rounds: int) -> dict[str, list[float]]:
    """Seconds of each call, every round calling each in turn (load hits all alike)."""
    for _ in range(warmup):
        for call in calls.values():
            jax.block_until_ready(call())
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            samples[name].append(time.perf_counter() - start)
    return samples


def median_ms(samples: list[float]) -> float:
    return round(float(np.median(samples)) * 1e3, 4)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A plain table of `rows` (dicts) under `columns`; missing cells print as '-'."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "-" if value is None else str(value)

    cells = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


@dataclass
class Pair:
    """Ours (`preset_programs`) and the peer (jit + dot_product_attention) on the same batch; each
    runner holds its state after the steps run so far."""
    model: ModelConfig
    batch: GlobalBatch
    runners: dict[str, mfu.Runner]
    labels: dict[str, str]
    cold: dict[str, Cold]
    first_loss: dict[str, float]

    def lowered(self, name: str) -> Any:
        """The step of `name` lowered for its current state (compiling it costs nothing:
        JAX keeps the executable the steps ran)."""
        runner = self.runners[name]
        return runner.lower(runner.state)

    def advance(self, name: str, steps: int) -> None:
        runner = self.runners[name]
        state = runner.state
        for _ in range(steps):
            state, metrics = runner.step(state)
        jax.block_until_ready((state, metrics))
        self.runners[name] = runner._replace(state=state)


def _out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def cold_runner(build: Callable[[], mfu.Runner]) -> tuple[mfu.Runner, Cold, float]:
    """build() and its first step, timed and counted: (runner at its next state, Cold, loss)."""
    out: dict[str, Any] = {}

    def first(runner: mfu.Runner) -> Any:
        out["state"], metrics = runner.step(runner.state)
        out["loss"] = metrics["loss"]
        return out["state"], metrics

    runner, cold = cold_start(build, first)
    return runner._replace(state=out["state"]), cold, float(out["loss"])


@dataclass
class Suite:
    """The run's settings and what sections share (built on first use)."""
    quick: bool
    seed: int = 0
    pairs: dict[str, Pair] = field(default_factory=dict)
    kernel_cases: tuple[str, ...] = ()  # the kernels section's cases to run (default all)

    @property
    def device(self) -> jax.Device:
        return jax.devices()[0]

    @property
    def on_gpu(self) -> bool:
        return self.device.platform in ("gpu", "cuda", "rocm")

    @property
    def rounds(self) -> int:
        return 5 if self.quick else 10

    def llama(self) -> ModelConfig:
        """The speed model: llama-1b on a GPU, the tiny preset in --quick."""
        return get_model_config("tiny" if self.quick else "llama-1b")

    def main_pair(self) -> Pair:
        """llama-1b at 4 x 2048 (quick: tiny at 4 x 64): what speed, startup, memory and
        profile all measure; built once."""
        return self.pair("4x2048" if not self.quick else "4x64", 4, 64 if self.quick else 2048)

    def pair(self, name: str, rows: int, seq_len: int,
             batch: GlobalBatch | None = None, remat: str | None = None) -> Pair:
        """The cached pair `name` (built and cold-started on first use); `remat`: ours' policy
        (None: chosen by the device's memory, as rh.fit chooses it)."""
        if name not in self.pairs:
            self.pairs[name] = self._build_pair(self.llama(), rows, seq_len, batch, remat)
        return self.pairs[name]

    def _build_pair(self, model: ModelConfig, rows: int, seq_len: int,
                    batch: GlobalBatch | None, remat: str | None) -> Pair:
        devices = [self.device]
        batch = batch or BatchIterator("synthetic:lognormal", n_microbatches=1,
                                       microbatch_size=rows, seq_len=seq_len,
                                       seed=self.seed).next_batch()
        plan = Plan.uniform(1, 1, 1, n_layers=model.n_layers, n_microbatches=1,
                            microbatch_size=rows, seq_len=seq_len,
                            device_ids=(int(devices[0].id),))
        # what the backward keeps, chosen by the device's memory as rh.fit chooses it (the
        # 32,768-token row needs a policy that recomputes; the peer keeps everything)
        if remat is None:
            remat, why = remat_for_memory(model, plan, devices_memory_gb(devices))
            print(f"  ours: remat {remat} ({why})")
        kinds: dict[str, str] = {}

        def build_ours() -> mfu.Runner:
            runner, kinds["ours"] = mfu.our_runner(model, StepConfig(remat=remat), plan,
                                                   devices, batch, self.seed)
            return runner

        def build_peer() -> mfu.Runner:
            kinds["peer"], runner = mfu.best_peer(model, devices, batch, self.seed)
            return runner

        try:
            ours, ours_cold, ours_loss = cold_runner(build_ours)
        except Exception as error:  # noqa: BLE001 - only running out of memory is retried
            # the memory model is an estimate: where the device runs out all the same, the
            # policy that recomputes most
            if remat == "full" or not _out_of_memory(error):
                raise
            print(f"  ours ran out of memory with remat {remat}: again with remat full")
            jax.clear_caches()
            remat = "full"
            ours, ours_cold, ours_loss = cold_runner(build_ours)
        peer, peer_cold, peer_loss = cold_runner(build_peer)
        return Pair(model, batch, {"ours": ours, "peer": peer},
                    {"ours": f"segment_attention[{kinds['ours']}], remat {remat}",
                     "peer": f"dot_product_attention[{kinds['peer']}]"},
                    {"ours": ours_cold, "peer": peer_cold},
                    {"ours": ours_loss, "peer": peer_loss})
