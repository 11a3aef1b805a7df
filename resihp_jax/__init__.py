"""resihp_jax: hybrid-parallel LLM training that stays fast when devices fail."""
