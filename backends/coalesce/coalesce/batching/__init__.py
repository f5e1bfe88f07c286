"""Coalescing: the pipeline over a task, the planner that cuts passes, and the cost model it cuts by."""
