"""Training: the step loop shared by both frameworks (``loop``, pure), checkpoints
(``checkpoint``: orbax; ``layout``: pure) and the JAX trainer (``run``). Import submodules
directly; this package imports nothing on its own, so torch_ref can use its pure modules without
loading JAX."""
