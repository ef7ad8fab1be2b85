"""jaxmem: decide, prove and run the cheapest memory strategy for training a transformer.

Submodules: ``config`` (model config and presets; imports no JAX), ``model`` (the Flax NNX
decoder), ``loss``, ``weights`` (safetensors exchange with PyTorch), ``train``, ``memory``,
``parity`` and ``cli``. Import them directly; this package imports nothing heavy on its own.
"""

__version__ = "0.1.0"
