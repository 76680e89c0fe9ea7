"""Choosing a layout before a run: the cost model, the planner and the out-of-memory ladder."""
