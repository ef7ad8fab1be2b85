"""``StepSpec``: everything that decides jaxmem's compiled training step, in one frozen object.

The trainer (``jaxmem train``), the records and plans of ``jaxmem memory``, ``peak`` and
``plan``, and the benchmark all describe the step they compile as a ``StepSpec`` and build it with
``jaxmem.step.build.build_step``, so what ``jaxmem plan`` compiled for a job is the program
``jaxmem train`` then runs (``tests/test_step_spec.py`` lowers both and compares them). What does
not change the program stays out: the data, the seed, the run's directory and its cadence (the
learning-rate schedule is the optimizer's, and in).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxmem.adapters import AdapterConfig
from jaxmem.config import AccumConfig, ModelConfig, OptimizerConfig, require
from jaxmem.memory.targets import LOCAL, Target
from jaxmem.parallel import ParallelConfig
from jaxmem.policy import MemoryPolicy
from jaxmem.policy_config import policy_from_dict, policy_to_dict
from jaxmem.precision import PRECISIONS, Precision

SINGLE_DEVICE = ParallelConfig()


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSpec:
    """One training step's program.

    Attributes:
      model: the decoder's architecture.
      policy: what the backward keeps, recomputes or offloads (and the loss's chunks).
      precision: parameter, compute, accumulator and loss dtypes, loss scaling.
      optimizer: the update and where its state and the parameters live between steps (device,
        host, or the stack streamed: ``optimizer.stream``).
      batch, seq_len: the global batch's rows and tokens per row.
      accum: microbatches per step and how they are summed.
      parallel: the mesh (one device by default) and the strategy over it.
      target: what the step is compiled for: the local backend (``LOCAL``) or a GPU target
        compiled without a GPU; it decides the attention kernel the model runs and, over a mesh,
        which devices the mesh names.
      loss_mask: the batch carries a ``mask`` ``[B, S]`` beside its inputs and targets
        (instruction data: the loss counts only the tokens it marks); without, no mask at all.
      adapters: LoRA adapters on a frozen base (``jaxmem.step.frozen``): only they (and the
        groups they unfreeze) get gradients and optimizer state. Default: none, every
        parameter trains.
      donate: the step donates its parameters and optimizer state (updated in place). False only
        where a program compiled from shapes cannot: a streamed step whose host-resident stack
        arrives in device memory there (XLA's host-offload check refuses a device argument
        donated to a host output).
    """

    model: ModelConfig
    policy: MemoryPolicy
    precision: Precision = PRECISIONS["fp32"]
    optimizer: OptimizerConfig = OptimizerConfig()
    batch: int
    seq_len: int
    accum: AccumConfig = AccumConfig()
    parallel: ParallelConfig = SINGLE_DEVICE
    target: Target = LOCAL
    loss_mask: bool = False
    adapters: AdapterConfig = AdapterConfig()
    donate: bool = True

    def __post_init__(self) -> None:
        for name, kind in (
            ("model", ModelConfig),
            ("policy", MemoryPolicy),
            ("precision", Precision),
            ("optimizer", OptimizerConfig),
            ("accum", AccumConfig),
            ("parallel", ParallelConfig),
            ("target", Target),
            ("adapters", AdapterConfig),
        ):
            value = getattr(self, name)
            require(
                isinstance(value, kind),
                f"StepSpec {name}={value!r} must be a {kind.__name__}",
            )
        for name in ("batch", "seq_len"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"StepSpec {name}={value!r} must be a positive integer",
            )
        for name in ("donate", "loss_mask"):
            value = getattr(self, name)
            require(isinstance(value, bool), f"StepSpec {name}={value!r} must be a bool")
        require(
            self.donate or self.streamed,
            "StepSpec donate=False is for a streamed step planned from shapes; an unstreamed "
            "step always donates its parameters and optimizer state",
        )
        self.accum.check_batch(self.batch)
        if self.sharded:
            self.parallel.check_batch(self.batch, self.accum.steps)

    @classmethod
    def of_job(cls, job: Any, target: Target = LOCAL, *, loss_mask: bool = False) -> StepSpec:
        """The step ``job`` (a ``jaxmem.job.JobConfig``) trains, compiled for ``target``;
        ``loss_mask``: on instruction data (its batches carry a mask)."""
        return cls(
            model=job.model,
            policy=job.memory,
            precision=job.precision,
            optimizer=job.optimizer,
            batch=job.run.batch_size,
            seq_len=job.run.seq_len,
            accum=job.accum,
            parallel=job.parallel,
            target=target,
            loss_mask=loss_mask,
            adapters=job.adapters,
        )

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-able data (``from_dict`` rebuilds it): for a child process that
        compiles it (``jaxmem.planner.peak``)."""
        plain = {
            name: dataclasses.asdict(getattr(self, name))
            for name in (
                "model",
                "precision",
                "optimizer",
                "accum",
                "parallel",
                "target",
                "adapters",
            )
        }
        return {
            **plain,
            "policy": policy_to_dict(self.policy),
            "batch": self.batch,
            "seq_len": self.seq_len,
            "donate": self.donate,
            "loss_mask": self.loss_mask,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepSpec:
        """The spec ``to_dict`` wrote."""
        return cls(
            model=ModelConfig(**data["model"]),
            policy=policy_from_dict(data["policy"]),
            precision=Precision(**data["precision"]),
            optimizer=OptimizerConfig(**data["optimizer"]),
            accum=AccumConfig(**data["accum"]),
            parallel=ParallelConfig(**data["parallel"]),
            target=Target(**data["target"]),
            adapters=AdapterConfig(
                **{
                    k: tuple(v) if isinstance(v, list) else v
                    for k, v in data.get("adapters", {}).items()
                }
            ),
            batch=data["batch"],
            seq_len=data["seq_len"],
            donate=data["donate"],
            loss_mask=data.get("loss_mask", False),
        )

    def replace(self, **changes: Any) -> StepSpec:
        return dataclasses.replace(self, **changes)

    @property
    def sharded(self) -> bool:
        """The step runs over a mesh of more than one device."""
        return self.parallel.sharded

    @property
    def streamed(self) -> bool:
        """The stack's parameters and state stream from host memory (``jaxmem.step.stream``)."""
        return self.optimizer.stream

    @property
    def data_devices(self) -> int:
        """Devices the batch's rows split over (the data axis; 1 on one device)."""
        return self.parallel.data if self.sharded else 1

    @property
    def micro_rows(self) -> int:
        """Rows of one microbatch on one data device."""
        return self.batch // self.accum.steps // self.data_devices
