"""Scheduler: from device health to the best next Plan, with baselines under one interface.

Pure numpy on top of the performance model; nothing here imports JAX.
"""

from resihp_jax.scheduler.context import PlanningContext, Policy, Proposal, SwitchCosts
from resihp_jax.perfmodel.health_spec import build_health, parse_dead, parse_slowdowns
from resihp_jax.scheduler.resihp import resihp
from resihp_jax.scheduler.policies import (BASELINES, OURS, POLICIES, Outcome, Reference, compare,
                                           get_policy, reference, run_policy)
from resihp_jax.scheduler.search import Candidate, clear_caches, search_plans

__all__ = ["BASELINES", "OURS", "POLICIES", "Candidate", "Outcome", "PlanningContext", "Policy",
           "Proposal", "Reference", "SwitchCosts", "build_health", "clear_caches", "compare",
           "get_policy", "parse_dead", "parse_slowdowns", "reference", "resihp", "run_policy",
           "search_plans"]
