"""The comparison wing: the only code that imports both JAX and PyTorch. Weight exchange
(``weights``), the tolerance table (``tolerances``), parity (``parity``), memory records of
torch_ref beside jaxmem's (``records``), the cross-framework benchmark (``bench``),
``jaxmem train --framework torch`` (``torch_run``) and the seeds' example in both frameworks
(``seed_example``, whose ``--framework jax`` runs without PyTorch). Only cross-framework commands
import it; it needs the ``torch`` extra (``pip install 'jaxmem[torch]'``)."""
