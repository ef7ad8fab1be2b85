"""The jitted training step: loss over microbatches, gradients, optimizer update
(``train_step``) and fp16's dynamic loss scaling (``scaling``). Import submodules directly; this
package imports nothing on its own."""
