"""Memory: the JAX translation of a policy (``remat``), the analytic model (``analytic``, pure),
what the backward keeps by jaxpr accounting and XLA's compiled plans (``residuals``), FLOPs
executed (``flops``), GPU targets (``targets``, pure) and deviceless compiles for them
(``gpu_plan``). Import submodules directly; this package imports nothing on its own."""
