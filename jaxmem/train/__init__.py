"""Training: the step loop shared by both frameworks (``loop``, pure), the checks before a run
(``prepare``, pure), the run directory (``run_dir``, pure), the orbax checkpoints of JAX runs
(``checkpoint``; the layout both frameworks share is ``jaxmem.run_layout``) and the JAX trainer
(``run``). Import submodules directly; this package imports nothing on its own, so its pure
modules load without JAX."""
