"""Measuring and choosing a step's memory: one training step's memory record, compiled for the
local backend or a GPU target (``records``), what is live at a compiled plan's peak (``peak``) and
the search for the cheapest configuration that fits a budget, in four parts: the lattice and its
order (``space``), the terms of a candidate's estimated step time (``cost``), the predictors of
its bytes and FLOPs (``predict``) and the loop that compiles candidates until one fits
(``search``). Import submodules directly; this package imports nothing on its own."""
