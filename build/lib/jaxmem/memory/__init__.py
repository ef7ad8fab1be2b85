"""Memory: the JAX translation of a policy (``remat``), the analytic model (``analytic``, pure),
what the backward keeps by jaxpr accounting and XLA's compiled plans (``residuals``), FLOPs
executed (``flops``) and one training step's memory record (``records``). Import submodules
directly; this package imports nothing on its own."""
