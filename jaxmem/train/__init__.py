"""Training: the step loop shared by both frameworks (``loop``, pure), the orbax checkpoints of
JAX runs (``checkpoint``; the layout both frameworks share is ``jaxmem.run_layout``), the JAX
trainer (``run``) and the seeds' example (``seed_example``). Import submodules directly; this
package imports nothing on its own, so its pure modules load without JAX."""
