"""Scheduler: from device health to the best next Plan, with baselines under one interface
(pure numpy on the performance model: nothing here imports JAX)."""

from resihp_jax.scheduler.context import PlanningContext, SwitchCosts
from resihp_jax.scheduler.resihp import resihp
from resihp_jax.scheduler.policies import BASELINES, OURS, POLICIES, compare, get_policy, run_policy
from resihp_jax.scheduler.search import search_plans

__all__ = ["BASELINES", "OURS", "POLICIES", "PlanningContext", "SwitchCosts", "compare",
           "get_policy", "resihp", "run_policy", "search_plans"]
