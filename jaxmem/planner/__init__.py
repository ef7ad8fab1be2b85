"""Measuring and choosing a step's memory: one training step's memory record, compiled for the
local backend or a GPU target (``records``), what is live at a compiled plan's peak (``peak``) and
the search for the cheapest configuration that fits a budget (``search``). Import submodules
directly; this package imports nothing on its own."""
