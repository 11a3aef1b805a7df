"""What the demo trains, always through the one step builder (what `rh.fit` builds: the model
split into shell and blocks, its step from `build_user_step`) under the ResilientTrainer:

- a preset (`--model tiny`, the default): `rh.models.Llama`, whose facts are its
  `ModelConfig` (the planner's analytic ones) and whose tensor parallelism is its own, so
  injected slowdowns reach it at any tp (the trainer's `build_step`);
- `--model gpt2`: a user's own NNX model (rh.models.GPT2, the model of
  examples/user_model/train_gpt2.py), its facts read off it by XLA (`build`).

Injected slowdowns act through the step's host callbacks, which run only where every mesh
axis is manual: a user's step is, under plans with tp == 1 (with tp > 1 XLA owns 'tp'). So
this model trains on tp == 1 plans only: the starting plan is checked, and its axis rules
put nothing on 'tp', so the scheduler's re-plans stay at tp == 1 as well (a re-plan onto
tp > 1 would silently drop the injected slowdown from the steps).

`DemoUserModel` is pure Python (checked before JAX starts); `build` starts the JAX side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from resihp_jax.errors import ConfigError
from resihp_jax.meshes.plan import Plan

if TYPE_CHECKING:
    from resihp_jax.runtime.run.user_programs import UserPrograms
    from resihp_jax.step.facts import UserModelFacts

# dp=4,pp=2 over dp=2,pp=4: on 8 fake CPU devices the same 12 steps of the same batches (16
# micro-batches of 2 x 256 tokens, same losses) took 81 s of CPU against 100 s, compiles
# included (two stages: fewer pipeline ticks and a smaller bubble than four). It also re-plans
# more finely around a slow device: four DP groups share the micro-batches (a slow group sheds
# some), and 2 layers per stage can move a layer off a slow stage (1 per stage cannot).
DEFAULT_PLAN = "dp=4,pp=2,tp=1"
# nothing on 'tp': the model's facts then shard no dimension, and the scheduler only plans
# tp == 1 (see the module docstring)
AXIS_RULES: tuple[tuple[str, str | None], ...] = ()
LEARNING_RATE = 3e-3  # the example's own optimizer: optax.adamw(3e-3)


@dataclass(frozen=True)
class DemoUserModel:
    """A user's model the demo builds, at sizes that train fast on 8 fake CPU devices; what
    the plan's checks ask of a model before JAX starts (Plan.check)."""
    name: str
    d_model: int
    n_heads: int
    n_layers: int
    vocab_size: int = 256  # byte tokens: the corpus and the synthetic data
    attn_block: int = 32  # its segment_attention's block: a row is a multiple of it
    dtype: str = "float32"  # 'bfloat16': bf16 compute from float32 weights (rh.fit's)

    @property
    def seq_multiple(self) -> int:
        return self.attn_block

    def tp_dims(self) -> tuple[int, ...]:
        return ()  # AXIS_RULES shard nothing over 'tp'

    def describe(self) -> str:
        return (f"{self.name} ({self.dtype}; your own NNX model rh.models.GPT2, "
                f"d={self.d_model}, {self.n_heads} heads, {self.n_layers} blocks, through "
                "rh.fit's path)")


USER_MODELS = {"gpt2": DemoUserModel("gpt2", d_model=64, n_heads=4, n_layers=4)}


def check_user_plan(plan: Plan, name: str, model: DemoUserModel) -> None:
    """Refuse tp > 1 for a user's model, naming `name` (a flag or a field) and what is valid."""
    if plan.tp != 1:
        raise ConfigError(
            f"{name}: tp={plan.tp} with model {model.name!r}: injected slowdowns reach a "
            "user's model only on plans with tp=1 (its step is manual over every mesh axis "
            f"only there); give tp=1, e.g. {DEFAULT_PLAN} or dp=2,pp=4,tp=1")


def build(model: DemoUserModel, plan: Plan, seed: int
          ) -> tuple[UserModelFacts, UserPrograms]:
    """(facts, programs) of `model` for rows of `plan.seq_len`, as `rh.fit` builds them (a
    model function: each program builds the parameters straight into its shardings)."""
    import optax  # noqa: PLC0415 - JAX starts after the devices are requested

    from resihp_jax.models import GPT2  # noqa: PLC0415
    from resihp_jax.runtime.run.user_programs import user_facts, user_programs  # noqa: PLC0415

    def make(rngs: Any) -> GPT2:
        return GPT2(vocab=model.vocab_size, d=model.d_model, heads=model.n_heads,
                    layers=model.n_layers, max_len=plan.seq_len, rngs=rngs)

    compute_dtype = None if model.dtype == "float32" else model.dtype
    programs = user_programs(make, optax.adamw(LEARNING_RATE), seed, axis_rules=AXIS_RULES,
                             compute_dtype=compute_dtype)
    return user_facts(programs, plan.seq_len), programs
