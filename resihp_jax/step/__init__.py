"""The one step builder every model trains through (docs/DESIGN.md, "Layout"): a model taken
apart into shell and stacked blocks (model_parts), its step program for any Plan (builder,
program, body, pipeline), its facts for the planner (facts) and the moves of its state
between plans (reshard)."""
