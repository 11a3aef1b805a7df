"""What each remat policy keeps for the backward of one `rh.models.Llama` block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import resihp_jax as rh
from resihp_jax.errors import ConfigError
from resihp_jax.step.body import rematted
from resihp_jax.step.config import REMAT_POLICIES, StepConfig


def _kept(remat: str, capsys: pytest.CaptureFixture) -> list[str]:
    """The residuals the backward keeps that the block computed (not its inputs)."""
    cfg = rh.engine.get_model_config("tiny")
    graph, state = nnx.split(rh.models.Llama(cfg, rngs=nnx.Rngs(0)).blocks[0])
    seg_BxS = jnp.ones((2, 32), jnp.int32)
    pos_BxS = jnp.broadcast_to(jnp.arange(32), (2, 32))
    loss = rematted(lambda s, x: jnp.sum(nnx.merge(graph, s)(x, seg_BxS, pos_BxS) ** 2), remat)
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(loss, state, jnp.ones((2, 32, cfg.d_model)))
    return [line for line in capsys.readouterr().out.splitlines()
            if "from the argument" not in line and "from a constant" not in line]


def test_projections_keep_the_seven_projections_and_the_attention_output_only(capsys) -> None:
    kept = _kept("projections", capsys)
    assert sum("output of dot_general" in line for line in kept) == 7  # q k v o gate up down
    assert sum("named 'context'" in line for line in kept) == 1
    assert len(kept) == 8
    assert _kept("full", capsys) == []  # the whole forward again
    assert len(_kept("none", capsys)) > 8  # norms, rotary, softmax statistics, ... too


def test_a_bad_remat_is_refused_by_name() -> None:
    assert StepConfig(remat=True).recomputes_forward
    assert not StepConfig(remat="projections").recomputes_forward
    for bad in ("some", 1, None):
        with pytest.raises(ConfigError, match=r"remat=.*valid are .auto. .*True, False"):
            StepConfig(remat=bad)


def test_the_cli_offers_the_same_policies() -> None:
    import argparse  # noqa: PLC0415

    from resihp_jax.cli.train import add_arguments  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    action = next(a for a in parser._actions if "--remat" in a.option_strings)
    assert tuple(action.choices) == ("auto", *REMAT_POLICIES) and action.const == "full"
    assert action.default == "auto"


def test_resihp_plan_plans_under_the_named_policy() -> None:
    import argparse  # noqa: PLC0415

    from resihp_jax.cli.next_plan import add_arguments, build_inputs  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    remat_of = lambda *flags: build_inputs(  # noqa: E731
        parser.parse_args(["--plan", "tp=1,dp=1,pp=2", "--model", "tiny", *flags]))[2].remat
    assert [remat_of(), remat_of("--remat"), remat_of("--no-remat"),
            remat_of("--remat", "projections")] == ["full", "full", "none", "projections"]
